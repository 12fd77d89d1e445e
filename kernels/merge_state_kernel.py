"""Jitted merge of split-KV partial states (launcher: merge_state.py).

Each partial is (o_s, lse_s) with o_s normalized over its split: o = sum_s exp(lse_s - m) o_s / sum_s exp(lse_s - m),
m = max_s lse_s (FlashInfer's merge_state, SGLang's decode stage 2). ROTATE: the merged row is written as o @ RT
(RT [D, D] fp32: KVQ_ROTATE=values' way back, sgl_kvq/attention_rotation.py), BLOCK_J output channels at a time."""

import triton
import triton.language as tl


@triton.jit
def _merge_state_kernel(
    O_part, LSE_part, num_splits, O, LSE, RT,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh, stride_mb, stride_mh,
    D: tl.constexpr, BLOCK_S: tl.constexpr, WRITE_LSE: tl.constexpr, ROTATE: tl.constexpr, BLOCK_J: tl.constexpr,
):
    # One program per (request, query head); all of its splits in one tile.
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    ns = tl.load(num_splits + b)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, D)
    mask_s = offs_s < ns
    lse = tl.load(LSE_part + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    m = tl.max(lse, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m_safe)
    o = tl.load(O_part + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                mask=mask_s[:, None], other=0.0)
    den = tl.sum(w, axis=0)
    # An empty context (no split saw a token) merges to 0 with lse -inf instead of 0/0.
    out = tl.sum(w[:, None] * o, axis=0) / tl.where(den > 0.0, den, 1.0)
    if ROTATE:
        for j in tl.static_range(D // BLOCK_J):
            offs_j = j * BLOCK_J + tl.arange(0, BLOCK_J)
            rt = tl.load(RT + offs_d[:, None] * D + offs_j[None, :])
            out_j = tl.sum(out[:, None] * rt, axis=0)
            tl.store(O + b * stride_ob + h * stride_oh + offs_j, out_j.to(O.dtype.element_ty))
    else:
        tl.store(O + b * stride_ob + h * stride_oh + offs_d, out.to(O.dtype.element_ty))
    if WRITE_LSE:
        lse_out = tl.where(den > 0.0, m_safe + tl.log(tl.where(den > 0.0, den, 1.0)), float("-inf"))
        tl.store(LSE + b * stride_mb + h * stride_mh, lse_out)
