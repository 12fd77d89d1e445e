"""The format extras of a layer view as the attention kernels take them: one argument group built here for the
decode, extend and SpeCache launchers.

    extras, consts = format_extras(kv, geometry)
    kernel[grid](..., extras, ..., **consts)        # consts: FORMAT (str) and SIZES (tuple of ints), constexprs

`extras` is the view's page tensors of its format (LayerKV.extras, the format's NamedTuple: PageCorrection,
PageRows, SalientPlane; () for plain KIVI pages). They are checked against the shapes the format declares
(Format.page_shapes, the declaration PoolShape.base_shapes allocates from), with the format's sizes read off the
view. FORMAT (Format.kernel) selects the format's in-register correction in format_extras_kernel.py; SIZES are its
sizes in page_shapes' keyword order. The jitted code indexes every extra tensor by its contiguous shape.

A format with a kernel adds: a row in FORMATS below (how its sizes are read off its tensors, with their bounds)
and its jitted correction, a branch of format_extras_kernel.py. A format whose Format.kernel is None has no
kernel: format_extras refuses its views.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

from sgl_kvq.formats.registry import of_extras
from sgl_kvq.layout import PageGeometry
from sgl_kvq.plan import LayerKV
from sgl_kvq.quant.zipcache_page import SALIENT_BITS

from .checks import require


def _gear_sizes(c: NamedTuple, g: PageGeometry) -> dict[str, int]:
    rank = c.k_u.shape[2]
    require(rank >= 1, "a GEAR correction needs rank >= 1")
    return dict(rank=rank, nk=c.k_out_val.shape[2], nv=c.v_out_val.shape[-1])


def _logquant_sizes(r: NamedTuple, g: PageGeometry) -> dict[str, int]:
    rows = r.row_off.shape[-1]
    require(rows >= 1 and g.G <= 128, f"LogQuant rows need M >= 1 slots and G <= 128 (255 marks empty), got {rows}, "
            f"{g.G}")
    return dict(rows=rows)


def _zipcache_sizes(s: NamedTuple, g: PageGeometry) -> dict[str, int]:
    salient = s.s_idx.shape[-1]
    require(1 <= salient < g.G, f"zipcache2 needs 1..G-1 salient tokens per page, got {salient}")
    return dict(salient=salient, salient_bits=SALIENT_BITS)


@dataclass(frozen=True)
class KernelFormat:
    label: str  # what the layout-check errors call its tensors (corr.k_w, rows.row_off, ...)
    sizes: Callable[[NamedTuple, PageGeometry], dict[str, int]]  # page_shapes' keywords, read off its tensors


FORMATS = {
    "gear": KernelFormat("corr", _gear_sizes),
    "logquant": KernelFormat("rows", _logquant_sizes),
    "zipcache": KernelFormat("sal", _zipcache_sizes),
}


def format_extras(kv: LayerKV, g: PageGeometry) -> tuple[tuple, dict]:
    """-> (the view's extra tensors, dict(FORMAT=..., SIZES=...)) after checking them against the layout; an empty
    extra tensor (gearl2's outliers) is passed as k_scale, never read, so that no pointer is null."""
    fmt = of_extras(kv.extras)
    require(fmt.kernel is not None, f"{fmt.family} has no Triton kernel: serve it with kvq_torch")
    if kv.extras is None:
        return (), dict(FORMAT="", SIZES=())
    tensors = kv.extras
    label, sizes = FORMATS[fmt.kernel].label, FORMATS[fmt.kernel].sizes(tensors, g)
    want = fmt.page_shapes(g, **sizes)
    for n, (shape, dtype) in want.items():
        t = getattr(tensors, n)
        require(tuple(t.shape) == shape and t.dtype == dtype,
                f"{label}.{n}: got {tuple(t.shape)} {t.dtype}, layout says {shape} {dtype}")
        require(t.is_contiguous() and t.device == kv.ov_k.device,
                f"{label}.{n} must be contiguous on the pool's device")
    stand_ins = {n: kv.k_scale for n in want if getattr(tensors, n).numel() == 0}
    return tensors._replace(**stand_ins), dict(FORMAT=fmt.kernel, SIZES=tuple(sizes.values()))
