"""GEAR on one page of G tokens: the exact format of a gear2 / gearl2 base page (see sgl_kvq/layout.py).

Per page and KV head, X = the page's K or V [G, D]:
    S  outliers (gear only): the NK entries of each key channel (over the page's G tokens) and the NV entries of each
       value token (over its D channels) farthest from their row's median, kept as fp16 value + uint8 index (token
       offset for keys, channel for values) and replaced by the row median before quantization, so they no longer
       stretch their group's range.
    D  KIVI's packed page of the filled X (kivi_page.pack_pages).
    L  u^T w, u [r, G], w [r, D]: a rank-r approximation of the residual X_filled - D (zero at outlier entries) by
       `iters` steps of power iteration from a fixed start, so a page always compresses the same way.
Read back: X_hat = D + u^T w, with the outlier entries replaced by S. Each term is per page and immutable, so a page
the radix tree shares reads the same for every request. The kernels add the correction to a page's tile in
registers (kernels/paged_kv_kernel.py) and never build a corrected page in memory.

Why per page: GEAR compresses its streaming buffer of n_b = 64 new tokens at rank 2 in decode (prefill: rank 4 over
the whole prompt). A page is that buffer, and the only unit a radix tree can share without re-compressing.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from sgl_kvq.formats.page_codec import PageCodec, PageWrite
from sgl_kvq.quant import kivi_page
from sgl_kvq.quant.uniform import SCALE_DTYPE


class PageCorrection(NamedTuple):
    """Per page n, KV head h. NK / NV = 0 for GEAR-L (the outlier tensors are then empty)."""
    k_u: torch.Tensor  # [N, H, r, G] fp16: keys' low-rank factor over the page's tokens
    k_w: torch.Tensor  # [N, H, r, D] fp16: ... and over channels; the correction is k_u^T @ k_w
    v_u: torch.Tensor  # [N, H, r, G] fp16
    v_w: torch.Tensor  # [N, H, r, D] fp16
    k_out_val: torch.Tensor  # [N, H, NK, D] fp16: channel d's j-th outlier value
    k_out_idx: torch.Tensor  # [N, H, NK, D] uint8: its token offset in the page
    v_out_val: torch.Tensor  # [N, G, H, NV] fp16: token t's j-th outlier value
    v_out_idx: torch.Tensor  # [N, G, H, NV] uint8: its channel


# The pool stores these per token slot ([S, H, NV]), the others per page ([P, ...]).
PER_SLOT = ("v_out_val", "v_out_idx")


def select_pages(pool: PageCorrection, pages: torch.Tensor) -> PageCorrection:
    """The pool's correction of one layer -> that of pool pages `pages` [N], in pack_gear_pages' form."""
    G = pool.k_u.shape[-1]
    slots = (pages[:, None] * G + torch.arange(G, device=pages.device)).reshape(-1)
    return PageCorrection(*(t[slots].view(pages.numel(), G, *t.shape[1:]) if name in PER_SLOT else t[pages]
                            for name, t in zip(PageCorrection._fields, pool)))


@functools.lru_cache(maxsize=None)
def _start(d: int, rank: int, device: torch.device) -> torch.Tensor:
    """The fixed power-iteration start [d, r] (GEAR starts from a random matrix; a seeded one keeps a page's
    compression a function of its contents)."""
    return torch.randn(d, rank, generator=torch.Generator().manual_seed(0), dtype=torch.float64).to(device)


def _orthonormal_columns(y: torch.Tensor) -> torch.Tensor:
    """Gram-Schmidt on the r columns of y [B, n, r]: plain tensor ops (no LAPACK QR), so it runs inside a CUDA
    graph; a zero column stays zero."""
    cols = []
    for j in range(y.shape[-1]):
        c = y[..., j]
        for q in cols:
            c = c - (q * c).sum(-1, keepdim=True) * q
        cols.append(c / c.norm(dim=-1, keepdim=True).clamp_min(1e-12))
    return torch.stack(cols, dim=-1)


def outliers_per_row(ratio: float, row_length: int) -> int:
    """fp16 outliers kept per row of `row_length` entries: round(s * length), at least one when s > 0."""
    return max(1, round(ratio * row_length)) if ratio > 0 else 0


def low_rank(a: torch.Tensor, rank: int, iters: int) -> tuple[torch.Tensor, torch.Tensor]:
    """a [B, n, d] -> (u [B, r, n], w [B, r, d]) float64 with u^T w ~= a, by power iteration (rank 0: empty).

    In float64 so that a page's factors, once rounded to fp16, do not depend on how many pages were compressed
    with it: a batched fp32 matmul may round differently at another batch size (cuBLAS picks its kernel by shape),
    and a contended server (retraction, chunked prefill) compresses a page in another batch than an uncontended
    one."""
    a = a.double()
    if rank == 0:
        return a.new_zeros(a.shape[0], 0, a.shape[1]), a.new_zeros(a.shape[0], 0, a.shape[2])
    w = _start(a.shape[-1], rank, a.device).expand(a.shape[0], -1, -1)
    for _ in range(iters):
        u = _orthonormal_columns(a @ w)  # [B, n, r]
        w = a.transpose(1, 2) @ u  # [B, d, r]: the projection of a on u's span
    return u.transpose(1, 2), w.transpose(1, 2)


def _outliers(x: torch.Tensor, n: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n entries of each row along `dim` farthest from the row median -> (indices along dim, median)."""
    med = x.median(dim=dim, keepdim=True).values
    return (x - med).abs().topk(n, dim=dim).indices, med


def pack_gear_pages(k: torch.Tensor, v: torch.Tensor, bits: int, value_group: int, rank: int, iters: int,
                    n_key_outliers: int, n_value_outliers: int, *,
                    specache_one_bit: bool = True) -> tuple[kivi_page.PackedPages, PageCorrection]:
    """k, v: [N, G, H, D] complete pages -> (the KIVI base of the outlier-filled pages, their correction)."""
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"expected k, v [N, G, H, D] of one shape, got {tuple(k.shape)} {tuple(v.shape)}")
    N, G, H, D = k.shape
    k, v = k.float(), v.float()
    k_idx, k_med = _outliers(k, n_key_outliers, dim=1) if n_key_outliers else (None, None)
    v_idx, v_med = _outliers(v, n_value_outliers, dim=-1) if n_value_outliers else (None, None)
    k_fill = k if k_idx is None else k.scatter(1, k_idx, k_med.expand_as(k_idx))
    v_fill = v if v_idx is None else v.scatter(-1, v_idx, v_med.expand_as(v_idx))
    base = kivi_page.pack_pages(k_fill, v_fill, bits, value_group, specache_one_bit=specache_one_bit)
    k_deq, v_deq = kivi_page.dequantize_pages(base, bits)
    factors = []
    for fill, deq, idx, dim in ((k_fill, k_deq, k_idx, 1), (v_fill, v_deq, v_idx, -1)):
        res = fill - deq
        if idx is not None:
            res = res.scatter(dim, idx, 0.0)
        u, w = low_rank(res.permute(0, 2, 1, 3).reshape(N * H, G, D), rank, iters)
        factors += [u.reshape(N, H, rank, G).to(SCALE_DTYPE).contiguous(),
                    w.reshape(N, H, rank, D).to(SCALE_DTYPE).contiguous()]
    if k_idx is None:
        k_val = k.new_zeros(N, H, 0, D, dtype=SCALE_DTYPE)
        k_pos = k.new_zeros(N, H, 0, D, dtype=torch.uint8)
    else:
        k_val = k.gather(1, k_idx).permute(0, 2, 1, 3).to(SCALE_DTYPE)
        k_pos = k_idx.permute(0, 2, 1, 3).to(torch.uint8)
    if v_idx is None:
        v_val = v.new_zeros(N, G, H, 0, dtype=SCALE_DTYPE)
        v_pos = v.new_zeros(N, G, H, 0, dtype=torch.uint8)
    else:
        v_val, v_pos = v.gather(-1, v_idx).to(SCALE_DTYPE), v_idx.to(torch.uint8)
    return base, PageCorrection(*factors, k_val.contiguous(), k_pos.contiguous(), v_val, v_pos)


def add_low_rank(x: torch.Tensor, u: torch.Tensor, w: torch.Tensor) -> None:
    """x [..., G, D] fp32 += u^T w with u [..., r, G], w [..., r, D] (leading dims broadcast), one rank-1 term at a
    time in order j = 0..r-1, as the kernels do: elementwise, so the sum is the same bits whatever the batch (a
    batched matmul can round differently at another batch size, and a request's tokens must not depend on what it
    was batched with)."""
    for j in range(u.shape[-2]):
        x += u[..., j, :, None].float() * w[..., j, None, :].float()


def correct_keys(k_hat: torch.Tensor, c: PageCorrection) -> torch.Tensor:
    """k_hat [N, G, H, D] fp32 (the pages' dequantized base) -> the corrected keys, in place."""
    add_low_rank(k_hat.transpose(1, 2), c.k_u, c.k_w)
    if c.k_out_val.shape[2]:
        k_hat.scatter_(1, c.k_out_idx.permute(0, 2, 1, 3).long(), c.k_out_val.permute(0, 2, 1, 3).float())
    return k_hat


def correct_values(v_hat: torch.Tensor, c: PageCorrection) -> torch.Tensor:
    """v_hat [N, G, H, D] fp32 -> the corrected values, in place."""
    add_low_rank(v_hat.transpose(1, 2), c.v_u, c.v_w)
    if c.v_out_val.shape[-1]:
        v_hat.scatter_(-1, c.v_out_idx.long(), c.v_out_val.float())
    return v_hat


def dequantize_gear_pages(base: kivi_page.PackedPages, c: PageCorrection, bits: int) -> tuple[torch.Tensor,
                                                                                            torch.Tensor]:
    k_hat, v_hat = kivi_page.dequantize_pages(base, bits)
    return correct_keys(k_hat, c), correct_values(v_hat, c)


class GearCodec(PageCodec):
    """gear2 (outliers=True) and gearl2 pages: KIVI's base of the filled page, then the low rank and outliers."""
    plain_pages = False

    def __init__(self, outliers: bool):
        self.outliers = outliers

    def outliers_per_row(self, cfg, row_length: int) -> int:
        """fp16 outliers kept per row of `row_length` entries (0 for GEAR-L)."""
        return outliers_per_row(cfg.params.outliers, row_length) if self.outliers else 0

    def pack(self, cfg, value_group: int, k, v, w: PageWrite, tables: dict):
        G, D = k.shape[1], k.shape[3]
        return pack_gear_pages(k, v, cfg.bits, value_group, cfg.params.rank, cfg.params.iters,
                               self.outliers_per_row(cfg, G), self.outliers_per_row(cfg, D),
                               specache_one_bit=cfg.specache_one_bit)

    def correct(self, k, v, extras, pages):
        pc = select_pages(extras, pages)
        return correct_keys(k, pc), correct_values(v, pc)

    def correct_padded(self, k, v, c: PageCorrection, ctx) -> None:
        """In correct_keys' order: low rank, then outliers replace their entries. Zeroed outside base
        pages/tokens (the overlay copy overwrites those positions; padding must stay finite)."""
        off_page = ~ctx.is_base_page[..., None, None, None]  # [B, U, 1, 1, 1]
        for x, u, w in ((k, c.k_u, c.k_w), (v, c.v_u, c.v_w)):
            add_low_rank(x, u[ctx.pages].float().masked_fill_(off_page, 0).permute(2, 0, 1, 3, 4),  # [H, B, U, r, G]
                         w[ctx.pages].float().masked_fill_(off_page, 0).permute(2, 0, 1, 3, 4))  # [H, B, U, r, D]
        if c.k_out_val.shape[2]:
            idx = c.k_out_idx[ctx.pages].long().masked_fill_(off_page, 0).permute(2, 0, 1, 3, 4)  # [H, B, U, NK, D]
            k.scatter_(3, idx, c.k_out_val[ctx.pages].float().masked_fill_(off_page, 0).permute(2, 0, 1, 3, 4))
        if c.v_out_val.shape[-1]:
            off_tok = ~ctx.is_base_tok[:, None, None]
            idx = c.v_out_idx[ctx.slots].long().masked_fill_(off_tok, 0).transpose(0, 1)  # [H, B * T, NV]
            val = c.v_out_val[ctx.slots].float().masked_fill_(off_tok, 0).transpose(0, 1)
            H, D = v.shape[0], v.shape[-1]
            v.view(H, -1, D).scatter_(2, idx, val)
