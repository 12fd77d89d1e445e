"""Extend attention: new tokens attend to their request's cached prefix (packed base pages + fp16 overlay frames,
the decode plan's page lists) and causally to their own fresh k/v, which are never re-read from the pool."""

from __future__ import annotations

import torch
import triton

from sgl_kvq.plan import LayerKV, PagedPlan

from .arg_groups import page_lists, pool_args
from .checks import MODEL_DTYPES, check_layer, check_paged, dot_in_fp32, layer_geometry, require
from .extend_attention_kernel import _extend_attention_kernel
from .format_extras import format_extras

LOG2E = 1.4426950408889634
_ROWS = 64  # query rows (tokens x GQA heads) per program: one 64-row tl.dot tile
_BLOCK_N = 64  # fresh keys per iteration


def extend_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, qo_indptr: torch.Tensor,
                     kv: LayerKV, paged: PagedPlan, sm_scale: float, max_qo_len: int | None = None,
                     out: torch.Tensor | None = None, window: int = -1) -> torch.Tensor:
    """q [N, Hq, D], k_new/v_new [N, H, D] (request b's rows are qo_indptr[b]:qo_indptr[b+1], int32 [B+1])
    -> out [N, Hq, D] in q's dtype. max_qo_len (the longest request's new tokens) sizes the grid; when None it is
    read from qo_indptr, which syncs with the device. window: a sliding layer's W, -1 for none (decode_attention)."""
    H, D, G, VG = check_layer(kv)
    extras, extras_consts = format_extras(kv, layer_geometry(kv))
    dev = kv.ov_k.device
    check_paged(paged, dev)
    N, Hq = q.shape[0], q.shape[1]
    B = paged.batch_size
    require(q.dim() == 3 and q.shape[2] == D and Hq % H == 0, f"q must be [N, Hq, D={D}], Hq a multiple of {H}")
    require(k_new.shape == (N, H, D) and v_new.shape == (N, H, D), f"k_new/v_new must be [N={N}, H={H}, D={D}]")
    for name, t in (("q", q), ("k_new", k_new), ("v_new", v_new)):
        require(t.dtype in MODEL_DTYPES and t.stride(-1) == 1 and t.device == dev,
                f"{name} must be a model dtype, contiguous in its last dim, on {dev}")
    require(qo_indptr.shape == (B + 1,) and qo_indptr.dtype == torch.int32 and qo_indptr.device == dev,
            f"qo_indptr must be [B+1={B + 1}] int32 on {dev}")
    if out is None:
        out = torch.empty_like(q)
    require(out.shape == q.shape and out.dtype in MODEL_DTYPES and out.stride(-1) == 1, "bad out")
    if max_qo_len is None:
        max_qo_len = int(qo_indptr.diff().max()) if B else 0
    if B == 0 or max_qo_len == 0:
        return out
    group = Hq // H
    gp = triton.next_power_of_2(group)
    block_m = max(1, _ROWS // gp)
    _extend_attention_kernel[(B, triton.cdiv(max_qo_len, block_m), H)](
        q, k_new, v_new, out, qo_indptr, pool_args(kv), extras, page_lists(paged), H, sm_scale * LOG2E,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        out.stride(0), out.stride(1), window,
        GROUP=group, GP=gp, BLOCK_M=block_m, BLOCK_N=_BLOCK_N, D=D, G=G, KBITS=kv.k_bits, VBITS=kv.v_bits, VG=VG,
        DOT_FP32=dot_in_fp32(q.dtype), **extras_consts,
    )
    return out
