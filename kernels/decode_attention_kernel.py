"""Jitted code of split-KV decode over packed base pages plus fp16 overlay frames (launcher: decode_attention.py).

Program (b, kv_head, split): the query heads of one KV head ([BLOCK_H, D], GQA group padded to a tl.dot tile)
walk a contiguous run of the request's logical pages (base pages, then overlay frames), one page of G tokens per
iteration, so each packed page is read once per KV head. Under a sliding window (window >= 0: the query at the
context's last position i sees i - window .. i) the splits share the pages from the first one the window reaches, the
tokens before it masked. It writes a normalized partial output and its
log-sum-exp; merge_state_kernel.py combines the splits. POOL, PAGES and PARTS are argument groups
(arg_groups.py), EXTRAS / CORRECT / SIZES the format's extras and
its corrections (format_extras.py).
"""

import triton
import triton.language as tl

from .paged_kv_kernel import _base_page_step, _frame_step, _window_valid


@triton.jit
def _decode_attention_kernel(
    Q, POOL, EXTRAS, PAGES, num_splits, PARTS, n_heads, sm_scale_log2, stride_qb, stride_qh, window,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, G: tl.constexpr, KBITS: tl.constexpr,
    VBITS: tl.constexpr, VG: tl.constexpr, CORRECT: tl.constexpr, SIZES: tl.constexpr, DOT_FP32: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ns = tl.load(num_splits + b)
    if split < ns:
        kv_lo = tl.load(PAGES.kv_indptr + b)
        n_base = tl.load(PAGES.kv_indptr + b + 1) - kv_lo
        ov_lo = tl.load(PAGES.ov_indptr + b)
        n_pages = n_base + tl.load(PAGES.ov_indptr + b + 1) - ov_lo
        last_base = tl.load(PAGES.kv_last_page_len + b)
        last_ov = tl.load(PAGES.ov_last_page_len + b)
        # the first position the window shows, lo, and the unit holding it; every unit but the last is whole
        base_len = tl.where(n_base > 0, (n_base - 1) * G + last_base, 0)
        ctx_len = base_len + tl.where(n_pages > n_base, (n_pages - n_base - 1) * G + last_ov, 0)
        lo = tl.where(window >= 0, tl.maximum(ctx_len - 1 - window, 0), 0)
        u_lo = tl.where(lo < base_len, lo // G, n_base + (lo - base_len) // G)
        per_split = tl.cdiv(n_pages - u_lo, ns)
        p_start = u_lo + split * per_split
        p_end = tl.minimum(p_start + per_split, n_pages)

        offs_h = tl.arange(0, BLOCK_H)
        heads = kvh * GROUP + offs_h
        mask_h = offs_h < GROUP
        offs_d = tl.arange(0, D)
        offs_t = tl.arange(0, G)
        q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=mask_h[:, None], other=0.0)
        dot_dtype = tl.float32 if DOT_FP32 else Q.dtype.element_ty
        q = q.to(dot_dtype)
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, D], tl.float32)

        for j in range(p_start, tl.minimum(p_end, n_base)):
            page = tl.load(PAGES.kv_indices + kv_lo + j).to(tl.int64)
            n_valid = tl.where(j == n_base - 1, last_base, G)
            valid = _window_valid(offs_t, j * G, n_valid, lo)
            m, l, acc = _base_page_step(q, m, l, acc, POOL, EXTRAS, page, n_valid, valid, kvh, n_heads, offs_t,
                                        offs_d, sm_scale_log2, G, D, KBITS, VBITS, VG, CORRECT, SIZES, DOT_FP32)

        for j in range(tl.maximum(p_start, n_base), p_end):
            frame = tl.load(PAGES.ov_indices + ov_lo + j - n_base).to(tl.int64)
            n_valid = tl.where(j == n_pages - 1, last_ov, G)
            valid = _window_valid(offs_t, base_len + (j - n_base) * G, n_valid, lo)
            m, l, acc = _frame_step(q, m, l, acc, POOL, frame, n_valid, valid, kvh, offs_t, offs_d, sm_scale_log2,
                                    DOT_FP32)

        # An empty split (possible when pages do not divide evenly) leaves l == 0: it stores o = 0, lse = -inf,
        # which the merge weighs by exp(-inf) = 0.
        has = l > 0.0
        o = acc / tl.where(has, l, 1.0)[:, None]
        lse = tl.where(has, (m + tl.log2(tl.where(has, l, 1.0))) * 0.6931471805599453, float("-inf"))
        o_off = b * PARTS.stride_ob + heads[:, None] * PARTS.stride_oh + split * PARTS.stride_os + offs_d[None, :]
        tl.store(PARTS.o + o_off, o, mask=mask_h[:, None])
        tl.store(PARTS.lse + b * PARTS.stride_lb + heads * PARTS.stride_lh + split, lse, mask=mask_h)
