"""How a format's pages are written and read in torch: the codec every path that does not run a Triton kernel uses
(the store's writes, the reference attention, kvq_torch's batched decode), and the reference its kernel variant is
tested against.

The defaults are KIVI's: complete pages compressed by kivi_page.pack_pages (or, bit for bit, by the Triton
quantize kernel: KernelVariant.quantize) and read back without correction. A format's codec overrides what it
changes; it lives in its package's codec.py.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl_kvq.padded import kivi_padded
from sgl_kvq.quant import kivi_page


class PageWrite(NamedTuple):
    """What a write of N complete pages knows besides their fp16 K/V [N, G, H, D]."""
    pages: torch.Tensor  # [N] pool pages they go to
    lpages: torch.Tensor | None = None  # [N] their logical page index in their request (None where not planned)
    received: torch.Tensor | None = None  # [N, G, H] attention each token received from its page's queries
    group: int = 1  # query heads per KV head
    bits: tuple[int, int] | None = None  # the layer's (key, value) code widths (the store sets them: layer_bits)


class PageCodec:
    # Whether a write needs the batch's queries (q=, sm_scale=).
    needs_queries: bool = False
    # Whether kvq_torch's decode may read its pages with the C kernel or the page-by-page torch path, which know
    # KIVI's codes, scales and zeros only.
    plain_pages: bool = True

    def tables(self, cfg, g, device: torch.device) -> dict[str, torch.Tensor]:
        """Constant lookup tables the writes read (not pool bytes: a function of the config alone; g: the layer's
        PageGeometry)."""
        return {}

    # ---- writes ----
    def pack(self, cfg, value_group: int, k: torch.Tensor, v: torch.Tensor, w: PageWrite,
             tables: dict) -> tuple[tuple, tuple | None]:
        """Complete pages k, v [N, G, H, D] of the served config cfg -> (the packed base, the extras in the pages'
        form or None). The base is a NamedTuple whose fields are Format.base_shapes' names (KIVI's PackedPages),
        each [N, ...] per page or [N, G, ...] per token slot; the store writes both by name."""
        k_bits, v_bits = w.bits or (cfg.bits, cfg.bits)
        return kivi_page.pack_pages(k, v, k_bits, value_group, specache_one_bit=cfg.specache_one_bit,
                                    v_bits=v_bits), None

    def page_write(self, store, layer: int, bw, q: torch.Tensor | None, kp: torch.Tensor, sm_scale: float | None,
                   w: PageWrite) -> PageWrite:
        """Complete what the write of a batch's completing pages needs before they are packed (bw: the BatchWrite,
        kp [N, G, H, D] the pages' keys, q the batch's queries). Called before the batch's frames are written."""
        return w

    def batch_frames_written(self, store, layer: int, bw, q: torch.Tensor | None, sm_scale: float | None) -> None:
        """After a batch's tokens were written to their frames (bw: the BatchWrite): update the per-frame state
        (Format.frame_shapes)."""

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
        k = kivi_page.dequantize_keys(k_codes, kv.k_scale[pages], kv.k_zero[pages], kv.k_bits)
        v = kivi_page.dequantize_values(kv.v_codes[slots], kv.v_scale[slots], kv.v_zero[slots], kv.v_bits)
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


KIVI_CODEC = PageCodec()
