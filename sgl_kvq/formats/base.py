"""What a served KV format declares: the one interface that the layout, the byte accounting, the store's writes,
the reference attention, kvq_torch's decode and the kernel launchers consult instead of testing a format's name.

The defaults are KIVI's packed base (layout.kivi_shapes: b-bit codes, key scales per page and channel, value scales
per token and channel group) with nothing added: pages compressed by kivi_page.pack_pages or, bit for bit, by the
Triton quantize kernel, and read back without correction. A format overrides what it changes; sgl_kvq/formats/
holds one package (or module) per family and registry.py maps each --kv-cache-dtype name to its format.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Protocol

import torch

from sgl_kvq.formats.rotation import VALUES_ROTATED
from sgl_kvq.layout import PageGeometry, Shapes, kivi_shapes
from sgl_kvq.padded import kivi_padded
from sgl_kvq.quant import kivi_page


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
    params: Any  # the family's own parameters (Format.params), None where it has none

    @property
    def name(self) -> str: ...

    @property
    def ring_pages(self) -> int: ...

    def value_group_for(self, head_dim: int) -> int: ...


class PageWrite(NamedTuple):
    """What a write of N complete pages knows besides their fp16 K/V [N, G, H, D]."""
    pages: torch.Tensor  # [N] pool pages they go to
    lpages: torch.Tensor | None = None  # [N] their logical page index in their request (None where not planned)
    received: torch.Tensor | None = None  # [N, G, H] attention each token received from its page's queries
    group: int = 1  # query heads per KV head


class Format:
    family: str = ""  # the dtype names are f"{family}{bits}"
    bits: tuple[int, ...] = ()  # code widths of the packed base
    # The NamedTuple of one layer's page tensors beside KIVI's (LayerKV.extras), its fields in page_shapes' order;
    # None: the pages carry nothing else.
    extras: type | None = None
    # The name of the format's Triton correction (its kernel_corrections), "" for KIVI's pages alone. None: no
    # Triton kernel reads this format, and kvq_triton refuses it before the model loads.
    kernel: str | None = ""
    # Whether the Triton quantize kernel writes its pages' codes (bit-exact with pack); False: torch compresses
    # them on both backends.
    quantize_kernel: bool = True
    # Whether a write needs the batch's queries (q=, sm_scale=).
    needs_queries: bool = False
    # Whether kvq_torch's decode may read its pages with the C kernel or the page-by-page torch path, which know
    # KIVI's codes, scales and zeros only.
    plain_pages: bool = True
    # How decode reads the KV, by name (sgl_kvq/strategies.py): "pool" reads the pool alone; "specache" adds
    # SpeCache's host tier and lanes.
    strategy: str = "pool"
    # The family's own parameters: a frozen dataclass (KVQConfig.params holds the served family's) whose fields its
    # KVQ_* variables set: knobs maps each to (field, parser); the config reads them beside the knobs every format
    # shares (sgl_kvq/env.py CORE_KNOBS), and check_params refuses their bad values. None: the family has none.
    params: type | None = None
    knobs: dict[str, tuple[str, Callable]] = {}

    @property
    def values_rotated(self) -> tuple[int, ...]:
        """The widths whose values are stored in the Hadamard basis unless KVQ_ROTATE says otherwise
        (KVQ_ROTATE=values), as sgl_kvq/formats/rotation.py chose them."""
        return VALUES_ROTATED.get(self.family, ())

    def kernel_corrections(self) -> tuple:
        """The jitted functions the attention kernels apply in registers to a dequantized base page, K^T [D, G] then
        V [G, D] (passed as constexprs: sgl_kvq/kernels/paged_kv_kernel.py); imported here, not with the
        declaration, so that only a process that runs a kernel imports Triton. Default: the pages as stored."""
        from sgl_kvq.formats.plain_kernel import _plain_kt, _plain_v

        return _plain_kt, _plain_v

    # ---- names and knobs ----
    def dtype_name(self, bits: int) -> str:
        """The --kv-cache-dtype name of width `bits` (KVQConfig.name)."""
        return f"{self.family}{bits}"

    def dtype_names(self) -> tuple[str, ...]:
        return tuple(self.dtype_name(b) for b in self.bits)

    def default_knobs(self, bits: int) -> dict:
        """Knob values this dtype defaults to where no KVQ_* variable sets them."""
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

    # ---- what a page and a frame hold ----
    def code_bits(self, bits: int) -> int:
        """The width of the base's packed codes (LayerKV.bits) for dtype width `bits`: the same for KIVI; a
        format storing part of its width elsewhere (a second code plane in its extras) says how much is base."""
        return bits

    def base_shapes(self, g: PageGeometry, bits: int) -> Shapes:
        """The base tensors every page holds, one layer's: KIVI's codes, scales and zeros, which the kernels, the
        pooled frames (a frame is k pages' code bytes) and the quantize kernel read. A format that is not KIVI's
        base (served through kvq_torch only, Format.kernel None) declares its own here, k_codes and v_codes
        [S, H, Dp] among them (the pooled frames' bytes), returns them from pack under these names and reads them
        in read_pages / read_padded (LayerKV's KIVI scales and zeros are then None)."""
        return kivi_shapes(g, self.code_bits(bits))

    def sizes(self, cfg: ServedConfig, g: PageGeometry) -> dict[str, int]:
        """page_shapes' keyword sizes from the config."""
        return {}

    def sizes_of(self, extras: tuple, g: PageGeometry) -> dict[str, int]:
        """The same sizes read off a layer view's extras (the kernels' launch arguments, checked against
        page_shapes): raises LayoutError where they are out of the bounds its kernel correction reads."""
        return {}

    def page_shapes(self, g: PageGeometry, **sizes) -> Shapes:
        """The tensors each page adds, one layer's (dims [P, ...] per page, [S, ...] per token slot), named as the
        fields of `extras`, in their order."""
        return {}

    def frame_shapes(self, g: PageGeometry) -> Shapes:
        """Per-request state kept with each overlay frame, one layer's, per frame (allocated [L, F, ...]; counted
        with the keys, sent with the frames under prefill/decode disaggregation)."""
        return {}

    def tables(self, cfg: ServedConfig, g: PageGeometry, device: torch.device) -> dict[str, torch.Tensor]:
        """Constant lookup tables the store's writes read (not pool bytes: a function of the config alone)."""
        return {}

    def stats(self, cfg: ServedConfig, sizes: dict[str, int]) -> dict:
        """The format's entries in the pool's stats["config"]."""
        return {}

    # ---- writes ----
    def pack(self, cfg: ServedConfig, value_group: int, k: torch.Tensor, v: torch.Tensor, w: PageWrite,
             tables: dict) -> tuple[kivi_page.PackedPages, tuple | None]:
        """Complete pages k, v [N, G, H, D] -> (the packed base, the extras in the pages' form or None). The base is
        a NamedTuple whose fields are base_shapes' names (KIVI's PackedPages), each [N, ...] per page or
        [N, G, ...] per token slot; the store writes both by name."""
        return kivi_page.pack_pages(k, v, self.code_bits(cfg.bits), value_group,
                                    specache_one_bit=cfg.specache_one_bit), None

    def kernel_extras(self, pages: torch.Tensor, lpages: torch.Tensor | None,
                      pages_kv: Callable[[], tuple[torch.Tensor, torch.Tensor]], tables: dict) -> tuple | None:
        """Where the quantize kernel wrote the codes of pool pages `pages`: their extras (pages_kv() gives their
        K/V [N, G, H, D]), or None."""
        return None

    def page_write(self, store, layer: int, bw, q: torch.Tensor | None, kp: torch.Tensor, sm_scale: float | None,
                   w: PageWrite) -> PageWrite:
        """Complete what the write of a batch's completing pages needs before they are packed (bw: the BatchWrite,
        kp [N, G, H, D] the pages' keys, q the batch's queries). Called before the batch's frames are written."""
        return w

    def batch_frames_written(self, store, layer: int, bw, q: torch.Tensor | None, sm_scale: float | None) -> None:
        """After a batch's tokens were written to their frames (bw: the BatchWrite): update the per-frame state."""

    def decode_frames_written(self, store, layer: int, dw, q: torch.Tensor | None,
                              sm_scale: float | None) -> torch.Tensor | None:
        """The same for a decode batch (dw: the DecodeWrite; static shapes, no host sync: CUDA graphs). -> what
        each row's page received (PageWrite.received of the pages the rows complete), or None."""
        return None

    # ---- reads ----
    def read_pages(self, kv, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference read of pool pages `pages` [N] of layer view kv -> k, v [N, G, H, D] fp32: KIVI's base
        dequantized, then the format's correction."""
        G, H, D = kv.G, kv.ov_k.shape[2], kv.ov_k.shape[3]
        n = pages.numel()
        slots = (pages[:, None] * G + torch.arange(G, device=pages.device)).reshape(-1)
        k_codes = kv.k_codes[slots].view(n, G, H, kv.k_codes.shape[-1])
        k = kivi_page.dequantize_keys(k_codes, kv.k_scale[pages], kv.k_zero[pages], kv.bits)
        v = kivi_page.dequantize_values(kv.v_codes[slots], kv.v_scale[slots], kv.v_zero[slots], kv.bits)
        return self.correct(k, v.view(n, G, H, D), kv.extras, pages)

    def read_padded(self, kv, ctx, ws) -> tuple[torch.Tensor, torch.Tensor]:
        """kvq_torch's batched decode read: the batch's base pages in the padded layout k, v [H, B * U * G, D]
        fp32 (padded.BatchedContext ctx; zeros outside base positions; in ws's buffers when given):
        KIVI's base dequantized, then the format's correction."""
        k, v = kivi_padded(kv, ctx, ws)
        B, U = ctx.pages.shape
        H, D = k.shape[0], k.shape[-1]
        self.correct_padded(k.view(H, B, U, kv.G, D), v.view(H, B, U, kv.G, D), kv.extras, ctx)
        return k, v

    def read_overlay(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The overlay frames' tokens k, v [..., D] (model dtype) as attention reads them, fp32: as stored for KIVI's
        family (the fp16 window is the format); a format that quantizes every token reads them through its
        quantizer, so a token of the open page reads the same before and after its page is packed."""
        return k.float(), v.float()

    def correct(self, k: torch.Tensor, v: torch.Tensor, extras: tuple | None,
                pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference read: pool pages `pages` [N] dequantized from KIVI's base, k, v [N, G, H, D] fp32 -> what
        the format reads (in place where it can). extras: the layer's (LayerKV.extras)."""
        return k, v

    def correct_padded(self, k: torch.Tensor, v: torch.Tensor, extras: tuple | None, ctx) -> None:
        """kvq_torch's batched decode: the same correction on the padded layout k, v [H, B, U, G, D] fp32 in place
        (ctx: padded.BatchedContext; positions outside base pages must stay finite)."""
