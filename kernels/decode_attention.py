"""Decode attention over the packed base plus the fp16 overlay: plan once per batch, run once per layer.

    p = plan(paged, num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=G)   # per batch
    o = decode_attention(q, layer_kv, p, sm_scale)                                # per layer (alias: run)

`paged` is sgl_kvq.plan.PagedPlan (FlashInfer paged metadata split into base pages and overlay frames).
plan() only launches device ops (no host sync), and max_splits depends on the batch size and the device alone,
so the launch grid (B, num_kv_heads, max_splits) is static for a CUDA graph of a given batch size; with a
DecodeWorkspace it allocates nothing either, so the graph captures fixed scratch addresses.
"""

from __future__ import annotations

import torch
import triton

from sgl_kvq.plan import DecodePlan, LayerKV, PagedPlan

from .arg_groups import page_lists, pool_args, split_parts
from .checks import MODEL_DTYPES, check_layer, check_paged, dot_in_fp32, layer_geometry, require
from .decode_attention_kernel import _decode_attention_kernel
from .format_extras import format_extras
from .merge_state import merge_state

LOG2E = 1.4426950408889634
# Target programs per SM for the split count: two resident programs hide the latency of the next page's loads.
_PROGRAMS_PER_SM = 2
_MAX_SPLITS_CAP = 64
# A split reads at least this many tokens: below it the partial write + merge costs more than the parallelism buys.
_MIN_TOKENS_PER_SPLIT = 256


def default_max_splits(device: torch.device, batch_size: int, num_kv_heads: int) -> int:
    if device.type != "cuda":
        return 2  # the interpreter's cost grows with programs: enough to exercise the merge
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = triton.cdiv(_PROGRAMS_PER_SM * sms, max(1, batch_size * num_kv_heads))
    return max(1, min(_MAX_SPLITS_CAP, want))


class DecodeWorkspace:
    """Split-KV scratch allocated once for batches of up to max_bs requests, so plan() allocates nothing and a
    CUDA graph captures fixed addresses: num_splits [max_bs] int32 and flat fp32 partials sized for the largest
    bs * max_splits(bs) (max_splits shrinks as the batch grows, so that product stays near 2 x SMs / KV heads)."""

    def __init__(self, max_bs: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, device: torch.device):
        most = max(bs * default_max_splits(device, bs, num_kv_heads) for bs in range(1, max_bs + 1))
        self.max_bs, self.num_qo_heads, self.head_dim = max_bs, num_qo_heads, head_dim
        self.num_splits = torch.ones(max_bs, dtype=torch.int32, device=device)
        self.o_partial = torch.empty(most * num_qo_heads * head_dim, dtype=torch.float32, device=device)
        self.lse_partial = torch.empty(most * num_qo_heads, dtype=torch.float32, device=device)


def plan(paged: PagedPlan, *, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
         max_splits: int | None = None, min_pages_per_split: int | None = None,
         workspace: DecodeWorkspace | None = None) -> DecodePlan:
    dev = paged.kv_indptr.device
    check_paged(paged, dev)
    require(num_qo_heads % num_kv_heads == 0, f"{num_qo_heads} query heads over {num_kv_heads} KV heads")
    B = paged.batch_size
    if max_splits is None:
        max_splits = default_max_splits(dev, B, num_kv_heads)
    if min_pages_per_split is None:
        min_pages_per_split = max(1, _MIN_TOKENS_PER_SPLIT // page_size)
    require(max_splits >= 1 and min_pages_per_split >= 1, "max_splits and min_pages_per_split must be >= 1")
    n_pages = paged.kv_indptr.diff() + paged.ov_indptr.diff()
    num_splits = ((n_pages + min_pages_per_split - 1) // min_pages_per_split).clamp(1, max_splits).to(torch.int32)
    if workspace is None:
        o_partial = torch.empty(B, num_qo_heads, max_splits, head_dim, dtype=torch.float32, device=dev)
        lse_partial = torch.empty(B, num_qo_heads, max_splits, dtype=torch.float32, device=dev)
    else:
        ws = workspace
        require(B <= ws.max_bs and (num_qo_heads, head_dim) == (ws.num_qo_heads, ws.head_dim),
                f"workspace for {ws.max_bs} requests x {ws.num_qo_heads} heads x D={ws.head_dim} cannot plan "
                f"{B} x {num_qo_heads} x D={head_dim}")
        n = B * num_qo_heads * max_splits
        require(n * head_dim <= ws.o_partial.numel(), f"workspace too small for {B} requests x {max_splits} splits")
        num_splits = ws.num_splits[:B].copy_(num_splits)
        o_partial = ws.o_partial[:n * head_dim].view(B, num_qo_heads, max_splits, head_dim)
        lse_partial = ws.lse_partial[:n].view(B, num_qo_heads, max_splits)
    return DecodePlan(
        paged=paged, num_splits=num_splits, max_splits=max_splits, num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, o_partial=o_partial,
        lse_partial=lse_partial,
    )


def decode_attention(q: torch.Tensor, kv: LayerKV, p: DecodePlan, sm_scale: float,
                     out: torch.Tensor | None = None, lse_out: torch.Tensor | None = None,
                     window: int = -1, out_rotation: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D] (one new token per request) -> out [B, Hq, D] in q's dtype; lse_out [B, Hq] fp32 if given.
    window: a sliding layer's W (the query at position i sees i - W .. i; sgl_kvq/attention_ref.py), -1 for none.
    out_rotation: RT [D, D] fp32, the output written as o @ RT by the split merge (KVQ_ROTATE=values' way back to
    the model's basis over values stored rotated)."""
    H, D, G, VG = check_layer(kv)
    require(q.dim() == 3 and tuple(q.shape) == (p.batch_size, p.num_qo_heads, D),
            f"q must be [B={p.batch_size}, Hq={p.num_qo_heads}, D={D}], got {tuple(q.shape)}")
    require(q.dtype in MODEL_DTYPES and q.stride(-1) == 1, f"q must be a contiguous-last-dim model dtype, {q.dtype}")
    require(q.device == kv.ov_k.device == p.num_splits.device, "q, the pool and the plan are on different devices")
    require((H, D, G) == (p.num_kv_heads, p.head_dim, p.page_size),
            f"plan was made for (H, D, G) = {(p.num_kv_heads, p.head_dim, p.page_size)}, pool has {(H, D, G)}")
    extras, extras_consts = format_extras(kv, layer_geometry(kv))
    if out is None:
        out = torch.empty_like(q)
    group = p.num_qo_heads // H
    if p.batch_size:
        _decode_attention_kernel[(p.batch_size, H, p.max_splits)](
            q, pool_args(kv), extras, page_lists(p.paged), p.num_splits, split_parts(p.o_partial, p.lse_partial), H,
            sm_scale * LOG2E, q.stride(0), q.stride(1), window,
            GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), D=D, G=G, KBITS=kv.k_bits,
            VBITS=kv.v_bits, VG=VG,
            DOT_FP32=dot_in_fp32(q.dtype), **extras_consts,
        )
    return merge_state(p.o_partial, p.lse_partial, p.num_splits, out=out, lse_out=lse_out, out_rotation=out_rotation)


run = decode_attention
