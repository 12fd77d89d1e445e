"""Jitted code of the single-token overlay write (launcher: store_overlay.py)."""

import triton
import triton.language as tl


@triton.jit
def _store_overlay_kernel(
    K, V, frames, offsets, OVK, OVV, RV,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_ov_frame, stride_ovv_frame, stride_ov_tok, stride_ov_head,
    H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, ROTATE_V: tl.constexpr,
):
    # One program per token row: all its heads at once. ROTATE_V: each head's value row is stored as v @ RV
    # (KVQ_ROTATE=values, RV [D, D] fp32), multiplied exactly in fp32 (BLOCK_H >= 16: a tl.dot tile).
    t = tl.program_id(0).to(tl.int64)
    f = tl.load(frames + t).to(tl.int64)
    o = tl.load(offsets + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D)
    mask = (offs_h < H)[:, None]
    row = o * stride_ov_tok + offs_h[:, None] * stride_ov_head + offs_d[None, :]
    k = tl.load(K + t * stride_k_tok + offs_h[:, None] * stride_k_head + offs_d[None, :], mask=mask)
    tl.store(OVK + f * stride_ov_frame + row, k.to(OVK.dtype.element_ty), mask=mask)
    v = tl.load(V + t * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :], mask=mask, other=0.0)
    if ROTATE_V:
        r = tl.load(RV + offs_d[:, None] * D + offs_d[None, :])
        v = tl.dot(v.to(tl.float32), r, input_precision="ieee")
    tl.store(OVV + f * stride_ovv_frame + row, v.to(OVV.dtype.element_ty), mask=mask)
