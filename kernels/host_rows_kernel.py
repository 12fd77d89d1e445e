"""Jitted code of SpeCache's host-tier row copies (launcher: host_rows.py). On CUDA the host tier is pinned memory
reached through unified virtual addressing, so these kernels read and write host RAM directly from the GPU, on the
side streams, with no CPU in the loop."""

import triton
import triton.language as tl


@triton.jit
def _scatter_rows_kernel(
    K, V, slots, HK, HV,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_h_slot, stride_h_head,
    H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # One program per token: HK[slots[t]] = K[t] (all heads), HV likewise.
    t = tl.program_id(0).to(tl.int64)
    s = tl.load(slots + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    mask = (offs_h < H)[:, None]
    dst = s * stride_h_slot + offs_h[:, None] * stride_h_head + offs_d[None, :]
    k = tl.load(K + t * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :], mask=mask)
    tl.store(HK + dst, k.to(HK.dtype.element_ty), mask=mask)
    v = tl.load(V + t * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :], mask=mask)
    tl.store(HV + dst, v.to(HV.dtype.element_ty), mask=mask)


@triton.jit
def _gather_head_rows_kernel(
    HK, HV, slots, heads, out_rows, OK, OV,
    stride_h_slot, stride_h_head, stride_o_row,
    D: tl.constexpr,
):
    # One program per copied row n: OK[out_rows[n]] = HK[slots[n], heads[n]] (one head's D channels); a slot < 0
    # gives a zero row.
    n = tl.program_id(0).to(tl.int64)
    s = tl.load(slots + n).to(tl.int64)
    h = tl.load(heads + n).to(tl.int64)
    r = tl.load(out_rows + n).to(tl.int64)
    offs_d = tl.arange(0, D)
    src = tl.maximum(s, 0) * stride_h_slot + h * stride_h_head + offs_d
    mask = offs_d < tl.where(s >= 0, D, 0)
    tl.store(OK + r * stride_o_row + offs_d, tl.load(HK + src, mask=mask, other=0.0).to(OK.dtype.element_ty))
    tl.store(OV + r * stride_o_row + offs_d, tl.load(HV + src, mask=mask, other=0.0).to(OV.dtype.element_ty))
