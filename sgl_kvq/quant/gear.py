"""GEAR and GEAR-L on a KIVI backbone: X ~= D + L (+ S).

    S  sparse outliers (GEAR only): the s% entries farthest from their row's median, kept as fp16 value + int32 flat
       index and removed BEFORE quantization (their slot is filled with the row median, so they no longer stretch
       the quantization range). Rows: per channel over the quantized tokens for keys (key outliers live in channels),
       per token over the D channels for values. round(s * row_length) entries per row.
    D  the KIVI pages of the filled tensor (keys per channel over G tokens, values per token in VG-channel groups).
    L  rank-r approximation, per KV head, of the residual R = X_filled - D (zero at outlier slots), by a few steps
       of seeded power iteration; its factors are stored as fp16 ([H, n, r] and [H, D, r]).
At outlier slots the stored fp16 value replaces D + L (storing S - D - L there instead gives the additive form
q.K^T = q.D^T + (q.B).A^T + q.S^T at the same byte cost).

Which variant where (GEAR paper, Kang et al. 2024): the accuracy tables report both GEAR (s = 2%) and GEAR-L (no
outliers); the system/throughput numbers come from GEAR-L on KIVI's kernels, since the official code only simulates
the sparse part. Rank defaults to 4 (the paper's prefill rank; 2 in decode).
The fp16 window and open page are KIVI's (they play GEAR's streaming buffer n_b), so gear vs kivi compares only
what GEAR adds.
"""

from __future__ import annotations

import torch

from sgl_kvq.quant.compressed import CompressedKV, check_kv
from sgl_kvq.quant.kivi import quantize_span, quantized_len


def outlier_mask(x: torch.Tensor, ratio: float, dim: int) -> torch.Tensor:
    """Boolean mask of the round(ratio * x.shape[dim]) entries of each row along `dim` farthest from the row median."""
    n = round(ratio * x.shape[dim])
    mask = torch.zeros_like(x, dtype=torch.bool)
    if n == 0 or x.numel() == 0:
        return mask
    dev = (x - x.median(dim=dim, keepdim=True).values).abs()
    return mask.scatter_(dim, dev.topk(n, dim=dim).indices, True)


def power_iteration(a: torch.Tensor, rank: int, iters: int, generator: torch.Generator):
    """a [H, n, d] -> (u [H, n, r] orthonormal columns, w [H, d, r]) with u @ w^T ~= a (rank r per head)."""
    H, n, d = a.shape
    r = min(rank, n, d)
    w = torch.randn(H, d, r, generator=generator, dtype=a.dtype)
    for _ in range(max(1, iters)):
        u = torch.linalg.qr(a @ w).Q  # [H, n, r]
        w = a.transpose(1, 2) @ u  # [H, d, r]: u u^T a, the projection of a on u's span
    return u, w


def _compress(x: torch.Tensor, name: str, outliers: torch.Tensor, rank: int, iters: int,
              generator: torch.Generator, quantized: tuple) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Second half of GEAR for one of k/v, after the backbone `quantized` = (filled x, x_hat of the backbone)."""
    filled, base = quantized
    residual = torch.where(outliers, torch.zeros_like(filled), filled - base)  # [n, H, D]
    stored = {}
    x_hat = base
    if rank > 0 and x.shape[0] > 0:
        u, w = power_iteration(residual.transpose(0, 1), rank, iters, generator)
        stored[f"{name}.lowrank_u"] = u.to(torch.float16)
        stored[f"{name}.lowrank_w"] = w.to(torch.float16)
        low = stored[f"{name}.lowrank_u"].float() @ stored[f"{name}.lowrank_w"].float().transpose(1, 2)
        x_hat = base + low.transpose(0, 1)
    if outliers.any():
        idx = outliers.reshape(-1).nonzero().squeeze(1)
        stored[f"{name}.outlier_val"] = x.reshape(-1)[idx].to(torch.float16)
        stored[f"{name}.outlier_idx"] = idx.to(torch.int32)
        x_hat = x_hat.reshape(-1).index_copy(0, idx, stored[f"{name}.outlier_val"].float()).reshape(x.shape)
    return x_hat, stored


def gear(k: torch.Tensor, v: torch.Tensor, *, bits: int = 2, group_size: int = 64, value_group: int = 64,
         residual: int = 64, rank: int = 4, iters: int = 3, outlier_ratio: float = 0.02, seed: int = 0,
         specache_one_bit: bool = True) -> CompressedKV:
    """GEAR; outlier_ratio=0 gives GEAR-L (see gear_l)."""
    T, H, D = check_kv(k, v)
    n_q = quantized_len(T, group_size, residual)
    kq, vq = k[:n_q].float(), v[:n_q].float()
    k_out = outlier_mask(kq, outlier_ratio, dim=0)  # per channel: over the tokens
    v_out = outlier_mask(vq, outlier_ratio, dim=-1)  # per token: over the channels
    k_fill = torch.where(k_out, kq.median(dim=0, keepdim=True).values, kq) if n_q else kq
    v_fill = torch.where(v_out, vq.median(dim=-1, keepdim=True).values, vq) if n_q else vq
    k_base, v_base, stored = quantize_span(k_fill, v_fill, bits, group_size, value_group,
                                           specache_one_bit=specache_one_bit)
    gen = torch.Generator().manual_seed(seed)
    k_hat, k_st = _compress(kq, "k", k_out, rank, iters, gen, (k_fill, k_base))
    v_hat, v_st = _compress(vq, "v", v_out, rank, iters, gen, (v_fill, v_base))
    stored.update(k_st)
    stored.update(v_st)
    stored["k.fp16"] = k[n_q:].to(torch.float16)
    stored["v.fp16"] = v[n_q:].to(torch.float16)
    kept = torch.zeros(T, H, dtype=torch.bool)
    kept[n_q:] = True
    return CompressedKV(torch.cat([k_hat, stored["k.fp16"].float()]), torch.cat([v_hat, stored["v.fp16"].float()]),
                        stored, kept)


def gear_l(k: torch.Tensor, v: torch.Tensor, **kw) -> CompressedKV:
    """GEAR-L: quantized backbone + low-rank residual, no sparse outliers."""
    return gear(k, v, outlier_ratio=0.0, **kw)
