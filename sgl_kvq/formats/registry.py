"""Every served format, and the map from a --kv-cache-dtype name to its format. Adding a format is one package in
sgl_kvq/formats/ (its declaration and parameters, page codec and Triton corrections) and one entry in FORMATS
(docs/formats.md)."""

from __future__ import annotations

from sgl_kvq.formats import gear, kivi, logquant, peers, specache, zipcache
from sgl_kvq.formats.base import Format

# The formats served at one width, which every dtype of theirs serves with no more than its name.
FORMATS: tuple[Format, ...] = (kivi.FORMAT, specache.FORMAT, gear.GEAR, gear.GEARL, logquant.FORMAT,
                               zipcache.FORMAT, *peers.FORMATS)
# The formats served from a recipe (a width per layer and per K/V, sgl_kvq/recipe.py): their dtype needs KVQ_RECIPE.
RECIPE_FORMATS: tuple[Format, ...] = (kivi.MIXED,)
ALL_FORMATS = FORMATS + RECIPE_FORMATS
BY_FAMILY = {f.family: f for f in ALL_FORMATS}
# The dtype names of FORMATS, in their order: what the tables and sweeps serve at their defaults.
DTYPE_NAMES = tuple(name for f in FORMATS for name in f.dtype_names())
RECIPE_DTYPE_NAMES = tuple(name for f in RECIPE_FORMATS for name in f.dtype_names())
# Each dtype name's format and code width; its keys are the names SGLang's --kv-cache-dtype gains (the CLI choices).
BY_NAME = {f.dtype_name(b): (f, b) for f in ALL_FORMATS for b in f.bits}
# The format whose extras are a NamedTuple type: how a layer view (LayerKV.extras) names its format.
_BY_EXTRAS = {f.extras: f for f in FORMATS if f.extras is not None}


def _knobs() -> dict[str, tuple]:
    out: dict[str, tuple] = {}
    for f in ALL_FORMATS:
        for var, knob in f.knobs.items():
            if out.setdefault(var, knob) != knob:
                raise ValueError(f"sgl_kvq: {var} is declared as two knobs, {out[var]} and {knob}")
    return out


# Every family's KVQ_* variables (Format.knobs), each naming one field of its parameters (Format.params).
KNOBS = _knobs()
# The extras tensors of each format with a Triton correction, by its kernel variant's name (tests/kernels/ check
# them).
EXTRA_SHAPES = {f.kernel.name: f.page_shapes for f in FORMATS if f.kernel is not None and f.kernel.name}


def family(name: str) -> Format | None:
    return BY_FAMILY.get(name)


def of_extras(extras: tuple | None) -> Format:
    """The format a layer view's extras belong to (KIVI's pages for none)."""
    if extras is None:
        return kivi.FORMAT
    fmt = _BY_EXTRAS.get(type(extras))
    if fmt is None:
        raise ValueError(f"sgl_kvq: a layer view carries {type(extras).__name__}, which no format declares")
    return fmt
