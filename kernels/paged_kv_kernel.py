"""Jitted helpers shared by the decode, extend and SpeCache kernels: read one page of K/V (packed base page
dequantized in registers, then the format's extras applied, or an fp16 overlay frame) and fold a tile of scores into
an online softmax.

Codes are packed along D (sgl_kvq/quant/unpack_kernel.py; 3 bits: two planes, each unpacked like the power-of-two
widths). Keys dequantize per channel with the page's scale/zero, values per token and VG-channel group. POOL is the
layer's pool group (arg_groups.PoolArgs); EXTRAS and SIZES are the format's extras, applied by its jitted
corrections CORRECT (a constexpr pair of functions, K's and V's, that its kernel variant gives:
KernelVariant.corrections; launcher side: format_extras.py).
"""

import triton
import triton.language as tl

from sgl_kvq.quant.unpack_kernel import _unpack, _unpack3


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    # fp32 operands are multiplied exactly ("ieee"), not in tf32: the fp32 path is the tight-tolerance oracle.
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _base_page_kt(POOL, page, kvh, offs_t, offs_d, G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    # -> K^T [D, G] fp32 of base page `page`, head kvh
    slots = page * G + offs_t
    rows = POOL.k_codes + slots[None, :] * POOL.stride_kc_slot + kvh * POOL.stride_kc_head
    if BITS == 3:
        codes = _unpack3(tl.load(rows + (offs_d // 4)[:, None]), tl.load(rows + (D // 4 + offs_d // 8)[:, None]),
                         offs_d[:, None])
    else:
        PB: tl.constexpr = 8 // BITS
        codes = _unpack(tl.load(rows + (offs_d // PB)[:, None]), offs_d[:, None], BITS)
    sz_off = page * POOL.stride_ks_page + kvh * POOL.stride_ks_head + offs_d
    ks = tl.load(POOL.k_scale + sz_off).to(tl.float32)
    kz = tl.load(POOL.k_zero + sz_off).to(tl.float32)
    return codes * ks[:, None] + kz[:, None]


@triton.jit
def _base_page_v(POOL, page, kvh, offs_t, offs_d, n_valid, G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                 VG: tl.constexpr):
    # -> V [G, D] fp32 of base page `page`, head kvh; rows >= n_valid are 0, never loaded: a slot past the
    # context may hold garbage scales (NaN/inf), and p = 0 times NaN would still poison p @ V.
    slots = page * G + offs_t
    rows = (offs_t < n_valid)[:, None]
    starts = POOL.v_codes + slots[:, None] * POOL.stride_vc_slot + kvh * POOL.stride_vc_head
    if BITS == 3:
        codes = _unpack3(tl.load(starts + (offs_d // 4)[None, :], mask=rows, other=0),
                         tl.load(starts + (D // 4 + offs_d // 8)[None, :], mask=rows, other=0), offs_d[None, :])
    else:
        PB: tl.constexpr = 8 // BITS
        codes = _unpack(tl.load(starts + (offs_d // PB)[None, :], mask=rows, other=0), offs_d[None, :], BITS)
    sz_off = slots[:, None] * POOL.stride_vs_slot + kvh * POOL.stride_vs_head + (offs_d // VG)[None, :]
    vs = tl.load(POOL.v_scale + sz_off, mask=rows, other=0.0).to(tl.float32)
    vz = tl.load(POOL.v_zero + sz_off, mask=rows, other=0.0).to(tl.float32)
    return codes * vs + vz


@triton.jit
def _page_kt(POOL, EXTRAS, page, kvh, n_heads, offs_t, offs_d, G: tl.constexpr, D: tl.constexpr,
             BITS: tl.constexpr, VG: tl.constexpr, CORRECT: tl.constexpr, SIZES: tl.constexpr):
    # -> K^T [D, G] fp32 of page `page`, head kvh, as its format reads it
    kt = _base_page_kt(POOL, page, kvh, offs_t, offs_d, G, D, BITS)
    return CORRECT[0](kt, EXTRAS, page, kvh, n_heads, offs_t, offs_d, G, D, VG, SIZES)


@triton.jit
def _page_v(POOL, EXTRAS, page, kvh, n_heads, offs_t, offs_d, n_valid, G: tl.constexpr, D: tl.constexpr,
            BITS: tl.constexpr, VG: tl.constexpr, CORRECT: tl.constexpr, SIZES: tl.constexpr):
    # -> V [G, D] fp32 of page `page`, head kvh, as its format reads it; rows >= n_valid are 0
    v = _base_page_v(POOL, page, kvh, offs_t, offs_d, n_valid, G, D, BITS, VG)
    return CORRECT[1](v, EXTRAS, page, kvh, n_heads, offs_t, offs_d, n_valid, G, D, VG, SIZES)


@triton.jit
def _softmax_step(qk, valid, m, l, acc, v, DOT_FP32: tl.constexpr):
    # qk [M, N] scores already in log2 units, valid [M, N] bool; v [N, D] -> updated (m, l, acc).
    # A row may have had no valid key yet (SpeCache masks its top-k positions out of base pages, so a page or a
    # whole split can be empty): its running max stays -inf, and exponents are taken against 0 instead, never
    # (-inf) - (-inf). Where the max is finite this is the plain online softmax.
    qk = tl.where(valid, qk, float("-inf"))
    m_new = tl.maximum(m, tl.max(qk, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_use)
    p = tl.exp2(qk - m_use[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_FP32)
    return m_new, l, acc


@triton.jit
def _base_page_step(q, m, l, acc, POOL, EXTRAS, page, n_valid, valid, kvh, n_heads, offs_t, offs_d, sm_scale_log2,
                    G: tl.constexpr, D: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, VG: tl.constexpr,
                    CORRECT: tl.constexpr, SIZES: tl.constexpr, DOT_FP32: tl.constexpr):
    # One packed base page (keys at KBITS, values at VBITS) into the online softmax of q [M, D] (already in the dot
    # dtype): -> updated (m, l, acc).
    # valid [M or 1, G]: the keys each row sees (tokens < n_valid, within a sliding window: _window_valid).
    kt = _page_kt(POOL, EXTRAS, page, kvh, n_heads, offs_t, offs_d, G, D, KBITS, VG, CORRECT, SIZES)
    qk = _dot(q, kt.to(q.dtype), DOT_FP32) * sm_scale_log2
    v = _page_v(POOL, EXTRAS, page, kvh, n_heads, offs_t, offs_d, n_valid, G, D, VBITS, VG, CORRECT, SIZES)
    return _softmax_step(qk, valid, m, l, acc, v.to(q.dtype), DOT_FP32)


@triton.jit
def _frame_step(q, m, l, acc, POOL, frame, n_valid, valid, kvh, offs_t, offs_d, sm_scale_log2,
                DOT_FP32: tl.constexpr):
    # One fp16 overlay frame into the online softmax of q [M, D]: -> updated (m, l, acc); valid as _base_page_step.
    base = frame * POOL.stride_ov_frame + kvh * POOL.stride_ov_head
    kt = tl.load(POOL.ov_k + base + offs_t[None, :] * POOL.stride_ov_tok + offs_d[:, None])
    qk = _dot(q, kt.to(q.dtype), DOT_FP32) * sm_scale_log2
    # rows past the frame's last token are never loaded: they may hold NaN (see _base_page_v)
    v_base = frame * POOL.stride_ovv_frame + kvh * POOL.stride_ov_head
    v = tl.load(POOL.ov_v + v_base + offs_t[:, None] * POOL.stride_ov_tok + offs_d[None, :],
                mask=(offs_t < n_valid)[:, None], other=0.0)
    return _softmax_step(qk, valid, m, l, acc, v.to(q.dtype), DOT_FP32)


@triton.jit
def _window_valid(offs_t, unit_pos, n_valid, first):
    # [M or 1, G] keys of a unit (its first token at context position unit_pos, n_valid tokens) that rows see: those
    # at or after the first visible position `first` (a sliding window; -1 for none): a scalar shared by every row,
    # or [M, 1], one per row
    return ((unit_pos + offs_t)[None, :] >= first) & (offs_t < n_valid)[None, :]
