"""What a served KV format declares: the one interface that the layout, the byte accounting, the store, the
reference attention, kvq_torch's decode and the kernel launchers consult instead of testing a format's name.

A format is three parts:
- its declaration (Format): dtype names, knobs and parameters, checks, the tensors a page and a frame hold;
- its codec (Format.codec, formats/page_codec.py): how pages are packed and read in torch;
- its kernel variant (Format.kernel, formats/kernel_variant.py): how the Triton kernels read them, or None.

The defaults are KIVI's packed base (layout.kivi_shapes: b-bit codes, key scales per page and channel, value scales
per token and channel group) with nothing added. A format overrides what it changes; sgl_kvq/formats/ holds one
package (or module) per family and registry.py maps each --kv-cache-dtype name to its format.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from sgl_kvq.formats.kernel_variant import KIVI_KERNEL, KernelVariant
from sgl_kvq.formats.page_codec import KIVI_CODEC, PageCodec
from sgl_kvq.formats.rotation import VALUES_ROTATED
from sgl_kvq.layout import PageGeometry, Shapes, kivi_shapes


class ServedConfig(Protocol):
    """The served config as a format reads it: sgl_kvq.config.KVQConfig, which sits above the formats (it parses a
    dtype name through their registry), so they name what they read here instead of importing it."""
    method: str
    bits: int
    group_size: int
    value_group: int
    residual: int
    prefill: str
    rotate: str
    specache_one_bit: bool
    params: Any  # the family's own parameters (Format.params), None where it has none

    @property
    def name(self) -> str: ...

    @property
    def ring_pages(self) -> int: ...

    def value_group_for(self, head_dim: int) -> int: ...


class Format:
    family: str = ""  # the dtype names are f"{family}{bits}"
    bits: tuple[int, ...] = ()  # code widths of the packed base
    # The NamedTuple of one layer's page tensors beside KIVI's (LayerKV.extras), its fields in page_shapes' order;
    # None: the pages carry nothing else.
    extras: type | None = None
    # How decode reads the KV, by name (sgl_kvq/strategies.py): "pool" reads the pool alone; "specache" adds
    # SpeCache's host tier and lanes.
    strategy: str = "pool"
    # The family's own parameters: a frozen dataclass (KVQConfig.params holds the served family's) whose fields its
    # KVQ_* variables set: knobs maps each to (field, parser); the config reads them beside the knobs every format
    # shares (sgl_kvq/env.py CORE_KNOBS), and check_params refuses their bad values. None: the family has none.
    params: type | None = None
    knobs: dict[str, tuple[str, Callable]] = {}
    codec: PageCodec = KIVI_CODEC
    kernel: KernelVariant | None = KIVI_KERNEL

    @property
    def values_rotated(self) -> tuple[int, ...]:
        """The widths whose values are stored in the Hadamard basis unless KVQ_ROTATE says otherwise
        (KVQ_ROTATE=values), as sgl_kvq/formats/rotation.py chose them."""
        return VALUES_ROTATED.get(self.family, ())

    # ---- names, knobs and checks ----
    def dtype_name(self, bits: int) -> str:
        """The --kv-cache-dtype name of width `bits` (KVQConfig.name)."""
        return f"{self.family}{bits}"

    def dtype_names(self) -> tuple[str, ...]:
        return tuple(self.dtype_name(b) for b in self.bits)

    def default_knobs(self, bits: int, params=None) -> dict:
        """Knob values this dtype defaults to where no KVQ_* variable sets them (params: the family's parameters,
        which may name some, as a recipe names its prefill)."""
        return {"rotate": "values"} if bits in self.values_rotated else {}

    def default_params(self, bits: int):
        """This dtype's parameters where no KVQ_* variable sets them (None where the family has none)."""
        return None if self.params is None else self.params()

    def check_params(self, params, group_size: int) -> None:
        """Refuse bad values of this family's parameters (its KVQ_* knobs), at page size `group_size`. Run for every
        family's knobs whatever is served: the environment is shared by every process a server spawns, so a bad
        value fails at once."""

    def check(self, cfg: ServedConfig) -> None:
        """Refuse a config this format cannot serve (run when it is the one served)."""

    def check_head_dim(self, cfg: ServedConfig, head_dim: int) -> None:
        """Refuse a head_dim this format cannot store (beside KVQConfig.check_head_dim's packing rules)."""

    def layer_bits(self, cfg: ServedConfig, layer: int) -> tuple[int, int]:
        """(key, value) code widths of pool layer `layer`: the dtype's width for both unless the format serves a
        width per layer (kivimix: its recipe's)."""
        return cfg.bits, cfg.bits

    def widths(self, cfg: ServedConfig) -> set[int]:
        """Every code width some layer's keys or values are stored at."""
        return {cfg.bits}

    def check_model(self, cfg: ServedConfig, layers: int, kv_heads: int, head_dim: int, config_sha256: str | None,
                    arch: str) -> None:
        """Refuse, before any weight loads, a model whose stored bytes this config was not made for (a recipe
        calibrated on another model)."""

    # ---- what a page and a frame hold ----
    def base_shapes(self, g: PageGeometry, bits: int, v_bits: int | None = None) -> Shapes:
        """The base tensors every page holds, one layer's: KIVI's codes, scales and zeros, which the kernels, the
        pooled frames (a frame is k pages' code bytes) and the quantize kernel read. A format that is not KIVI's
        base (served through kvq_torch only, kernel None) declares its own here, k_codes and v_codes [S, H, Dp]
        among them (the pooled frames' bytes), returns them from its codec's pack under these names and reads them
        in read_pages / read_padded (LayerKV's KIVI scales and zeros are then None). v_bits: the values' width
        where a layer's differs from its keys' (layer_bits)."""
        return kivi_shapes(g, bits, v_bits)

    def sizes(self, cfg: ServedConfig, g: PageGeometry) -> dict[str, int]:
        """page_shapes' keyword sizes from the config (the kernel variant reads the same off a layer view)."""
        return {}

    def page_shapes(self, g: PageGeometry, **sizes) -> Shapes:
        """The tensors each page adds, one layer's (dims [P, ...] per page, [S, ...] per token slot), named as the
        fields of `extras`, in their order."""
        return {}

    def frame_shapes(self, g: PageGeometry) -> Shapes:
        """Per-request state kept with each overlay frame, one layer's, per frame (allocated [L, F, ...]; counted
        with the keys, sent with the frames under prefill/decode disaggregation)."""
        return {}

    def stats(self, cfg: ServedConfig, sizes: dict[str, int]) -> dict:
        """The format's entries in the pool's stats["config"]."""
        return {}

