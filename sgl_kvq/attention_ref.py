"""Torch reference of attention over the packed paged base plus the fp16 overlay frames.

This is the oracle of the Triton kernels and the compute of the `kvq_torch` backend. It dequantizes per request,
only the pages that request references: never the whole pool.

The plan (FlashInfer's paged metadata, split in two page lists per request; built once per batch, used by every
layer). A request's context is its base pages followed by its overlay frames, in position order:
    kv_indptr         [B + 1] int32  request b's base pages are kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
    kv_indices        [nnz]   int32  pool page ids (quantized, immutable pages)
    kv_last_page_len  [B]     int32  tokens used in b's last base page (G unless b has no overlay frames)
    ov_indptr         [B + 1] int32  request b's overlay frames are ov_indices[ov_indptr[b]:ov_indptr[b + 1]]
    ov_indices        [nnz_ov] int32 overlay frame ids (fp16 copies of b's most recent pages)
    ov_last_page_len  [B]     int32  tokens used in b's last frame (1..G)
Only a request's last page (base or overlay, whichever list ends its context) may be partial.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kvq.quant import kivi_page


@dataclass
class PagedPlan:
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    ov_indptr: torch.Tensor
    ov_indices: torch.Tensor
    ov_last_page_len: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.kv_indptr.numel() - 1

    def base_len(self, b: int, G: int) -> int:
        n = int(self.kv_indptr[b + 1] - self.kv_indptr[b])
        return 0 if n == 0 else (n - 1) * G + int(self.kv_last_page_len[b])

    def overlay_len(self, b: int, G: int) -> int:
        n = int(self.ov_indptr[b + 1] - self.ov_indptr[b])
        return 0 if n == 0 else (n - 1) * G + int(self.ov_last_page_len[b])

    def seq_len(self, b: int, G: int) -> int:
        return self.base_len(b, G) + self.overlay_len(b, G)


@dataclass
class LayerKV:
    """One layer's view of the pool (shapes in sgl_kvq/layout.py, layer dim removed)."""
    k_codes: torch.Tensor  # [S, H, Dp] uint8
    k_scale: torch.Tensor  # [P, H, D] fp16
    k_zero: torch.Tensor
    v_codes: torch.Tensor  # [S, H, Dp] uint8
    v_scale: torch.Tensor  # [S, H, D // VG] fp16
    v_zero: torch.Tensor
    ov_k: torch.Tensor  # [F, G, H, D] model dtype
    ov_v: torch.Tensor
    bits: int

    @property
    def G(self) -> int:
        return self.ov_k.shape[1]


def gather_context(kv: LayerKV, plan: PagedPlan, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request b's keys and values, [T, H, D] fp32, dequantized from its own pages only."""
    G = kv.G
    pages = plan.kv_indices[plan.kv_indptr[b]:plan.kv_indptr[b + 1]].long()
    slots = (pages[:, None] * G + torch.arange(G, device=pages.device)).reshape(-1)
    n = pages.numel()
    H, D = kv.ov_k.shape[2], kv.ov_k.shape[3]
    k_base = kivi_page.dequantize_keys(kv.k_codes[slots].view(n, G, H, kv.k_codes.shape[-1]), kv.k_scale[pages], kv.k_zero[pages],
                                       kv.bits).reshape(n * G, H, D)
    v_base = kivi_page.dequantize_values(kv.v_codes[slots], kv.v_scale[slots], kv.v_zero[slots], kv.bits)
    frames = plan.ov_indices[plan.ov_indptr[b]:plan.ov_indptr[b + 1]].long()
    k_ov = kv.ov_k[frames].float().reshape(-1, H, D)
    v_ov = kv.ov_v[frames].float().reshape(-1, H, D)
    nb, no = plan.base_len(b, G), plan.overlay_len(b, G)
    k = torch.cat([k_base[:nb], k_ov[:no]])
    v = torch.cat([v_base[:nb], v_ov[:no]])
    return k, v


def attention_probs(q: torch.Tensor, k: torch.Tensor, sm_scale: float, mask=None) -> torch.Tensor:
    """q [N, Hq, D], k [T, H, D] (GQA: query head i reads KV head i // (Hq / H)) -> softmax [Hq, N, T] fp32."""
    group = q.shape[1] // k.shape[1]
    s = torch.einsum("nhd,thd->hnt", q.float(), k.float().repeat_interleave(group, dim=1)) * sm_scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1)


def weighted_values(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """p [Hq, N, T] from attention_probs, v [T, H, Dv] -> [N, Hq, Dv] fp32."""
    return torch.einsum("hnt,thd->nhd", p, v.float().repeat_interleave(p.shape[0] // v.shape[1], dim=1))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, mask=None) -> torch.Tensor:
    """q [N, Hq, D], k/v [T, H, D] (GQA: Hq a multiple of H) -> [N, Hq, Dv] fp32."""
    return weighted_values(attention_probs(q, k, sm_scale, mask), v)


def ref_decode(q: torch.Tensor, kv: LayerKV, plan: PagedPlan, sm_scale: float) -> torch.Tensor:
    """q [B, Hq, D]: one query per request over its whole context -> [B, Hq, Dv] in q's dtype."""
    out = torch.empty(q.shape[0], q.shape[1], kv.ov_v.shape[-1], dtype=q.dtype, device=q.device)
    for b in range(plan.batch_size):
        k, v = gather_context(kv, plan, b)
        out[b] = _attend(q[b:b + 1], k, v, sm_scale)[0].to(q.dtype)
    return out


def ref_extend(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, qo_indptr: torch.Tensor, kv: LayerKV,
               plan: PagedPlan, sm_scale: float,
               contexts: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
    """Extend: request b's new tokens q/k_new/v_new[qo_indptr[b]:qo_indptr[b+1]] attend to b's cached prefix (the
    plan's pages and frames, all visible; or contexts[b] = its K/V [T, H, D] from elsewhere, e.g. SpeCache's
    16-bit host tier) and causally to the new tokens (fresh, never re-read from the pool)."""
    out = torch.empty(q.shape[0], q.shape[1], v_new.shape[-1], dtype=q.dtype, device=q.device)
    for b in range(plan.batch_size):
        lo, hi = int(qo_indptr[b]), int(qo_indptr[b + 1])
        if hi == lo:
            continue
        kp, vp = gather_context(kv, plan, b) if contexts is None else (contexts[b][0].float(), contexts[b][1].float())
        k = torch.cat([kp, k_new[lo:hi].float()])
        v = torch.cat([vp, v_new[lo:hi].float()])
        n, p = hi - lo, kp.shape[0]
        mask = torch.ones(n, p + n, dtype=torch.bool, device=q.device)
        mask[:, p:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        out[lo:hi] = _attend(q[lo:hi], k, v, sm_scale, mask).to(q.dtype)
    return out
