"""Jitted code of extend (prefill / continuation) attention (launcher: extend_attention.py).

Program (b, m_block, kv_head): BLOCK_M new tokens of request b times the GQA group of kv_head, flattened to
ROWS = BLOCK_M * GP query rows (row r = token r // GP, head r % GP), so every packed page is read once per KV head
and token block. It attends to all of b's cached prefix (base pages dequantized in registers, then overlay frames)
and causally to b's fresh k/v, in one online softmax; under a sliding window (window >= 0) a row at context
position i sees i - window .. i only, and the pages and fresh-key blocks before its block's first row's window are
not read. POOL and PAGES are argument groups (arg_groups.py),
EXTRAS / CORRECT / SIZES the format's extras and its
corrections (format_extras.py).
"""

import triton
import triton.language as tl

from .paged_kv_kernel import _base_page_step, _dot, _frame_step, _softmax_step, _window_valid


@triton.jit
def _extend_attention_kernel(
    Q, K_new, V_new, O, qo_indptr, POOL, EXTRAS, PAGES, n_heads, sm_scale_log2,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, window,
    GROUP: tl.constexpr, GP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
    G: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr, VG: tl.constexpr, CORRECT: tl.constexpr,
    SIZES: tl.constexpr, DOT_FP32: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    m_start = tl.program_id(1) * BLOCK_M
    kvh = tl.program_id(2)
    q_lo = tl.load(qo_indptr + b).to(tl.int64)
    n_new = tl.load(qo_indptr + b + 1) - q_lo
    if m_start < n_new:
        ROWS: tl.constexpr = BLOCK_M * GP
        rows = tl.arange(0, ROWS)
        tok = m_start + rows // GP
        heads = kvh * GROUP + rows % GP
        mask_r = (tok < n_new) & (rows % GP < GROUP)
        offs_d = tl.arange(0, D)
        offs_t = tl.arange(0, G)
        q = tl.load(Q + (q_lo + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_r[:, None], other=0.0)
        dot_dtype = tl.float32 if DOT_FP32 else Q.dtype.element_ty
        q = q.to(dot_dtype)
        m = tl.full([ROWS], float("-inf"), tl.float32)
        l = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, D], tl.float32)

        kv_lo = tl.load(PAGES.kv_indptr + b)
        n_base = tl.load(PAGES.kv_indptr + b + 1) - kv_lo
        last_base = tl.load(PAGES.kv_last_page_len + b)
        ov_lo = tl.load(PAGES.ov_indptr + b)
        n_ov = tl.load(PAGES.ov_indptr + b + 1) - ov_lo
        last_ov = tl.load(PAGES.ov_last_page_len + b)
        base_len = tl.where(n_base > 0, (n_base - 1) * G + last_base, 0)
        prefix = base_len + tl.where(n_ov > 0, (n_ov - 1) * G + last_ov, 0)
        # each row's first visible context position (-1: no window), and the block's first row's, which bounds
        # what any of its rows reads
        row_first = tl.where(window >= 0, prefix + tok - window, -1)
        lo = tl.where(window >= 0, tl.maximum(prefix + m_start - window, 0), 0)
        for j in range(tl.minimum(lo // G, n_base), n_base):
            page = tl.load(PAGES.kv_indices + kv_lo + j).to(tl.int64)
            n_valid = tl.where(j == n_base - 1, last_base, G)
            valid = _window_valid(offs_t, j * G, n_valid, row_first[:, None])
            m, l, acc = _base_page_step(q, m, l, acc, POOL, EXTRAS, page, n_valid, valid, kvh, n_heads, offs_t,
                                        offs_d, sm_scale_log2, G, D, KBITS, VBITS, VG, CORRECT, SIZES, DOT_FP32)

        for j in range(tl.maximum(lo - base_len, 0) // G, n_ov):
            frame = tl.load(PAGES.ov_indices + ov_lo + j).to(tl.int64)
            n_valid = tl.where(j == n_ov - 1, last_ov, G)
            valid = _window_valid(offs_t, base_len + j * G, n_valid, row_first[:, None])
            m, l, acc = _frame_step(q, m, l, acc, POOL, frame, n_valid, valid, kvh, offs_t, offs_d, sm_scale_log2,
                                    DOT_FP32)

        # the new tokens, causally (and within the window); keys past this block's last token are invisible to all
        # of its rows, and so are blocks before its first row's window
        offs_n = tl.arange(0, BLOCK_N)
        first_new = tl.where(window >= 0, tl.maximum(m_start - window, 0) // BLOCK_N * BLOCK_N, 0)
        for start in range(first_new, tl.minimum(n_new, m_start + BLOCK_M), BLOCK_N):
            kn = start + offs_n
            in_range = kn < n_new
            kt = tl.load(K_new + (q_lo + kn)[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None],
                         mask=in_range[None, :], other=0.0)
            qk = _dot(q, kt.to(dot_dtype), DOT_FP32) * sm_scale_log2
            v = tl.load(V_new + (q_lo + kn)[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
                        mask=in_range[:, None], other=0.0)
            valid = (kn[None, :] <= tok[:, None]) & in_range[None, :] & (prefix + kn[None, :] >= row_first[:, None])
            m, l, acc = _softmax_step(qk, valid, m, l, acc, v.to(dot_dtype), DOT_FP32)

        o = acc / l[:, None]
        tl.store(O + (q_lo + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(O.dtype.element_ty), mask=mask_r[:, None])
