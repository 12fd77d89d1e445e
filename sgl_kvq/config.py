"""The one frozen config that flows from `--kv-cache-dtype` to the pool, the backends and the kernels.

A dtype name is `<method><bits>` or a peer's `peer_<format>`; the registry (`sgl_kvq/formats/registry.py`) holds
them all and maps each to its format.
Knobs that SGLang's command line has no room for come from environment variables with the `KVQ_` prefix (read in one
place, `sgl_kvq.env`), so they reach SGLang's spawned scheduler processes unchanged. Defaults are the papers': G = 64,
residual window R = 64 (SpeCache's G and R; KIVI's paper uses G = 32 and R = 32..128). Every knob, its default and
why: docs/knobs.md.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from sgl_kvq import env
from sgl_kvq.attention_rotation import ROTATIONS
from sgl_kvq.errors import KVQConfigError
from sgl_kvq.formats import registry
from sgl_kvq.formats.base import Format
from sgl_kvq.recipe import load_recipe

# Each format family's dtype names, bit widths and what its pages add are declared by its module in
# sgl_kvq/formats/; the registry maps a name to its format.
METHOD_BITS = {f.family: f.bits for f in registry.ALL_FORMATS}
METHODS = tuple(METHOD_BITS)
BITS = (1, 2, 3, 4)
# The dtype names SGLang's --kv-cache-dtype gains. Every one is served by the same pool and backends; a recipe's
# (kivimix) needs KVQ_RECIPE besides its name.
DTYPE_NAMES = registry.DTYPE_NAMES
RECIPE_DTYPE_NAMES = registry.RECIPE_DTYPE_NAMES
ALL_DTYPE_NAMES = DTYPE_NAMES + RECIPE_DTYPE_NAMES

# Every KVQ_* variable sgl_kvq's config reads: the core knobs (KVQConfig's fields) and each format family's own
# (Format.knobs: fields of its params).
KNOBS = {**env.CORE_KNOBS, **registry.KNOBS}

PREFILL_MODES = env.PREFILL_MODES
FRAME_MODES = ("pooled", "static")


@dataclass(frozen=True)
class KVQConfig:
    method: str  # a METHOD_BITS key
    # code width of keys and values in the packed base: 1, 2, 3 or 4 (specache: 1 or 2); kivimix: 4, the widest a
    # layer may take, each layer's keys and values at its recipe's widths (layer_bits)
    bits: int
    group_size: int = 64  # G: tokens per page = key quantization group (keys per-channel over a page)
    value_group: int = 64  # channels per value quantization group (values per-token); clipped to head_dim
    residual: int = 64  # R: most recent complete tokens kept fp16 in the overlay, a multiple of G
    # 1-bit codes use SpeCache's zero-point (3 min + max)/4 and scale (max - min)/2 (eq. 3), which halves the
    # reconstruction error of plain min/max 1-bit (tests/unit/test_quant_properties.py measures it).
    specache_one_bit: bool = True
    # How an extend (prefill, multi-turn continuation) attends to its own new tokens:
    #   "full"  KIVI's prefill: the new tokens attend each other in full precision; only the cached prefix is
    #           read quantized. A recomputed token (after retraction, eviction, a chunk boundary, a cache miss)
    #           can therefore differ from when it was decoded.
    #   "paged" page by page, each new page attending to the pages before it exactly as decode reads them (packed
    #           base beyond the fp16 window): a token's KV no longer depends on how it was scheduled.
    # kivi3 and kivi4 default to "paged", every other dtype to "full" (docs/knobs.md, KVQ_PREFILL).
    prefill: str = "full"
    # The share of SGLang's KV budget that per-slot state may take when --max-running-requests is not given: SpeCache's
    # top-k buffers, and the overlay frames where they cannot be pooled (prefill/decode disaggregation); it sets
    # their default max_running_requests (sgl_kvq/capacity.py). Pooled frames (the default) need no share. 0.06 costs
    # static frames little of the packed capacity ratio (docs/knobs.md, KVQ_OVERLAY_SHARE).
    overlay_share: float = 0.06
    # Intra-op threads kvq_torch's batched decode attention runs with on a CPU (0: torch's own count, the
    # process's). 0 by default because on a quiet machine the second thread is faster; 1 is for a machine other
    # processes load, where each of the attention's OpenMP barriers waits for a descheduled thread (docs/knobs.md,
    # KVQ_ATTENTION_THREADS; bench/results/decode-work-quiet-smollm2.json).
    attention_threads: int = 0
    # 1: kvq_torch decodes the codes-scales-zeros formats (kivi1/2/3/4) on a CPU with the compiled C kernel
    # (kernels/cpu_decode_attention.c) when a C compiler is found, else its torch paths; 0: always the torch paths.
    # On by default because the kernel decodes faster than both the torch paths and bf16's own decode
    # (docs/knobs.md, KVQ_CPU_KERNEL; bench/results/decode-kernel-smollm2.json).
    cpu_kernel: int = 1
    # "pooled": running requests' fp16 frames are pages of the pool, taken from the KV budget while they run
    # (sgl_kvq/frames.py); "static": `ring` frames per request slot in a region of their own, sized by
    # overlay_share (what prefill/decode disaggregation always uses). Pooled by default because pooled frames run as
    # many requests as memory holds where static frames run few (docs/knobs.md, KVQ_FRAMES;
    # bench/results/serving-concurrency-smollm2.json).
    frames: str = "pooled"
    # The basis K and V are quantized in (sgl_kvq/attention_rotation.py): "values" rotates V along head_dim by the
    # normalized (block) Hadamard matrix before it is written and the attention output back; "hadamard" rotates q and
    # K alike too (attention is unchanged by either; the quantization error is not); "none" stores them as computed.
    # Each format's default is sgl_kvq/formats/rotation.py's (docs/knobs.md, KVQ_ROTATE).
    rotate: str = "none"
    # The served family's own parameters (Format.params: GEAR's rank, LogQuant's window, SpeCache's top-k, ...), set
    # by its KVQ_* knobs; None: the dtype's defaults (Format.default_params).
    params: Any = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise KVQConfigError(f"sgl_kvq: unknown method {self.method!r}; known: {', '.join(METHODS)}")
        if self.bits not in METHOD_BITS[self.method]:
            raise KVQConfigError(f"sgl_kvq: {self.method} supports {METHOD_BITS[self.method]}-bit codes, "
                                 f"not {self.bits}")
        g = self.group_size
        if g < 8 or g & (g - 1):
            raise KVQConfigError(f"sgl_kvq: group size G={g} must be a power of two >= 8 (it is the page size)")
        if self.value_group < 8 or self.value_group & (self.value_group - 1):
            raise KVQConfigError(f"sgl_kvq: value group {self.value_group} must be a power of two >= 8")
        if self.prefill not in PREFILL_MODES:
            raise KVQConfigError(f"sgl_kvq: prefill mode {self.prefill!r}; choose one of {', '.join(PREFILL_MODES)}")
        if self.residual < 0 or self.residual % g:
            raise KVQConfigError(f"sgl_kvq: residual window R={self.residual} must be a multiple of G={g}")
        if self.rotate not in ROTATIONS:
            raise KVQConfigError(f"sgl_kvq: KVQ_ROTATE={self.rotate!r}; choose one of {', '.join(ROTATIONS)}")
        if self.frames not in FRAME_MODES:
            raise KVQConfigError(f"sgl_kvq: KVQ_FRAMES={self.frames!r}; choose one of {', '.join(FRAME_MODES)}")
        if not 0 < self.overlay_share < 1:
            raise KVQConfigError(f"sgl_kvq: KVQ_OVERLAY_SHARE={self.overlay_share} must be in (0, 1), e.g. 0.06")
        if self.attention_threads < 0:
            raise KVQConfigError(f"sgl_kvq: KVQ_ATTENTION_THREADS={self.attention_threads} must be 0 (torch's own "
                                 "thread count) or more, e.g. 1")
        if self.cpu_kernel not in (0, 1):
            raise KVQConfigError(f"sgl_kvq: KVQ_CPU_KERNEL={self.cpu_kernel} must be 0 (torch paths) or 1 (the C "
                                 "decode kernel where a C compiler is found)")
        fmt = self.format
        if self.params is None:
            object.__setattr__(self, "params", fmt.default_params(self.bits))
        if not isinstance(self.params, fmt.params or type(None)):
            want = "no parameters" if fmt.params is None else fmt.params.__name__
            raise KVQConfigError(f"sgl_kvq: {self.name} takes {want}, not {self.params!r}")
        if self.params is not None:
            fmt.check_params(self.params, self.group_size)
        fmt.check(self)

    @property
    def format(self) -> Format:
        """What the served format declares (sgl_kvq/formats/)."""
        return registry.BY_FAMILY[self.method]

    @property
    def name(self) -> str:
        return self.format.dtype_name(self.bits)

    @property
    def fingerprint(self) -> str:
        """Everything that decides what a stored page's bytes mean and what a request's frames hold: the dtype, G,
        the value group, R, the rotation, the 1-bit zero/scale, and the family's parameters that change its pages
        (all of them unless its params class names them in STORED). Two processes with different fingerprints must
        never read each other's pages: prefill/decode disaggregation refuses the pair (patches/pd.py) and HiCache's
        storage tiers key pages on it (host_pool.py). Made of [A-Za-z0-9._-] only, so it can name a file."""
        parts = [self.name, f"G{self.group_size}", f"VG{self.value_group}", f"R{self.residual}",
                 f"rotate-{self.rotate}"]
        if 1 in self.format.widths(self):
            parts.append("zero-specache" if self.specache_one_bit else "zero-minmax")
        if self.params is not None:
            stored = getattr(self.params, "STORED", None)
            parts += [f"{f.name}-{getattr(self.params, f.name)}" for f in dataclasses.fields(self.params)
                      if stored is None or f.name in stored]
        return "_".join(parts)

    def layer_bits(self, layer: int) -> tuple[int, int]:
        """(key, value) code widths of pool layer `layer` (a recipe's, or bits for both)."""
        return self.format.layer_bits(self, layer)

    @property
    def page_size(self) -> int:
        return self.group_size

    @property
    def ring_pages(self) -> int:
        """fp16 overlay frames per running request: the open page plus R/G window pages."""
        return 1 + self.residual // self.group_size

    def value_group_for(self, head_dim: int) -> int:
        return min(self.value_group, head_dim)

    def check_head_dim(self, head_dim: int, v_head_dim: int | None = None) -> None:
        for what, d in (("head_dim", head_dim), ("v_head_dim", v_head_dim or head_dim)):
            for b in sorted(self.format.widths(self)):
                if d % 8 or (d * b) % 8:
                    raise KVQConfigError(f"sgl_kvq: {what}={d} cannot be packed at {b} bit (needs a multiple of 8)")
            if d % self.value_group_for(d):
                raise KVQConfigError(
                    f"sgl_kvq: {what}={d} is not a multiple of the value group {self.value_group_for(d)}")
            self.format.check_head_dim(self, d)


def knob_names() -> tuple[str, ...]:
    """The variables KVQConfig reads."""
    return tuple(KNOBS)


def is_kvq_dtype(name: object) -> bool:
    return isinstance(name, str) and name in ALL_DTYPE_NAMES


def looks_like_kvq_dtype(name: object) -> bool:
    """A name meant for sgl_kvq (a known method with any suffix), valid or not: it gets sgl_kvq's error."""
    return isinstance(name, str) and any(name.startswith(m) for m in METHODS)


def parse_kv_cache_dtype(name: str) -> KVQConfig:
    """`kivi2` -> KVQConfig(method="kivi", bits=2, ...) with the KVQ_* knobs applied. Parsed once per name and knob
    values in each process: every caller (dtype resolution, sizing, the pool, the launch helpers) gets the same
    object."""
    return _parse(name, env.knob_values(KNOBS))


def default_config(name: str, recipe: str | None = None) -> KVQConfig:
    """`name`'s config with every knob at its default, whatever KVQ_* variables are set (the decision table's bytes
    per token: the dtype as a user who sets nothing gets it); recipe: kivimix's KVQ_RECIPE value."""
    return _build(name, {}, {} if recipe is None else {"kivimix": {"recipe": load_recipe(recipe)}})


@functools.lru_cache(maxsize=None)
def _parse(name: str, knob_values: tuple) -> KVQConfig:
    return _build(name, env.knobs(env.CORE_KNOBS), {f.family: env.knobs(f.knobs) for f in registry.ALL_FORMATS})


def _build(name: str, knobs: dict, family_knobs: dict) -> KVQConfig:
    """knobs: the core knobs set (CORE_KNOBS' fields); family_knobs: family -> its params' fields set."""
    if name not in registry.BY_NAME:
        raise KVQConfigError(f"sgl_kvq: unknown kv cache dtype {name!r}; choose one of {', '.join(ALL_DTYPE_NAMES)}")
    fmt, bits = registry.BY_NAME[name]
    params = fmt.default_params(bits)
    if params is not None:
        params = dataclasses.replace(params, **family_knobs.get(fmt.family, {}))
    knobs = {**fmt.default_knobs(bits, params), **knobs}
    group_size = knobs.get("group_size", KVQConfig.group_size)
    for other in registry.ALL_FORMATS:  # every family's knobs are checked: the environment is shared
        if other.params is not None and other is not fmt and family_knobs.get(other.family):
            other.check_params(dataclasses.replace(other.default_params(other.bits[0]),
                                                   **family_knobs[other.family]), group_size)
    return KVQConfig(method=fmt.family, bits=bits, params=params, **knobs)
