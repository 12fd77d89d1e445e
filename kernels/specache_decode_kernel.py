"""Jitted code of SpeCache's two decode lanes over packed KIVI pages, fp16 overlay frames and each request's
prefetched 16-bit top-k rows (launcher and the Algorithm 3 semantics: specache_decode.py).

Program (b, kv_head, split): the query heads of KV head kv_head of BOTH lanes of request b ([BLOCK_M, D]: lane-major,
GROUP heads per lane, padded to a tl.dot tile) read the same keys, so each packed page is read once for both rows.
Splits 0..ns-1 walk contiguous runs of the request's logical pages (base pages, then overlay frames) and write
partial slot split + 1; a base position named by the request/head's top-k set is masked out there (its 16-bit copy
replaces it). Split max_splits is the 16-bit split, written to partial slot 0: the usable top-k rows (0 <= pos <
base tokens) plus, for the speculative lane only, the row's own K/V (index K of the tile, never stored).
The speculative lane's scores over the packed base (log2 units, top-k positions from their 16-bit rows) go to
SCORES [n_req, Hq, T] so the next top-k is selected on the device; with FOLLOW both lanes' do, lane-major
([NLANES * n_req, Hq, T]: the real rows' mass one position later joins the ranking, specache_mass_kernel.py).

Under a sliding window (window >= 0; -1 for none) each tile row sees its own window (the output lane's row at the
context's last position ctx - 1 sees ctx - 1 - window on, the speculative lane's, its own key at ctx, ctx - window
on): pages, frames and top-k rows before it are masked per row, its scores there never stored, and the splits share
the pages from the first one the earliest row's window reaches.

Masking can leave a base page (or a whole split) without a valid key: _softmax_step keeps m = -inf there, and an
empty split stores lse = -inf, which merge_state weighs by 0. POOL, TOPK, PAGES and PARTS are argument groups
(arg_groups.py, specache_decode.TopKArgs), EXTRAS / CORRECT / SIZES the format's extras and
corrections (format_extras.py; the launcher takes plain KIVI pages, whose corrections are the identity).
"""

import triton
import triton.language as tl

from .paged_kv_kernel import _dot, _frame_step, _page_kt, _page_v, _softmax_step, _window_valid


@triton.jit
def _specache_decode_kernel(
    Q, POOL, EXTRAS, KOWN, VOWN, TOPK, PAGES, num_splits, PARTS, SCORES, sm_scale_log2, n_req, n_heads,
    stride_qb, stride_qh, stride_kob, stride_koh, stride_vob, stride_voh, stride_sb, stride_sh, window,
    # BITS: (key, value) code widths, one parameter (a recipe's layer stores them apart)
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
    VG: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
    NLANES: tl.constexpr, SPEC_LANE: tl.constexpr, USE_TOPK: tl.constexpr, FOLLOW: tl.constexpr,
    MAX_SPLITS: tl.constexpr, TOPK_ROWS: tl.constexpr, CORRECT: tl.constexpr, SIZES: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ns = tl.load(num_splits + b)
    if (split < ns) | (split == MAX_SPLITS):
        kv_lo = tl.load(PAGES.kv_indptr + b)
        n_base = tl.load(PAGES.kv_indptr + b + 1) - kv_lo
        ov_lo = tl.load(PAGES.ov_indptr + b)
        n_pages = n_base + tl.load(PAGES.ov_indptr + b + 1) - ov_lo
        last_base = tl.load(PAGES.kv_last_page_len + b)
        last_ov = tl.load(PAGES.ov_last_page_len + b)
        base_tokens = tl.where(n_base > 0, (n_base - 1) * G + last_base, 0)

        offs_m = tl.arange(0, BLOCK_M)
        lane = offs_m // GROUP
        mask_m = offs_m < NLANES * GROUP
        heads = kvh * GROUP + offs_m % GROUP
        rows = b + lane * n_req  # q row of each tile row: lane-major [lane 0 rows, lane 1 rows]
        spec = (lane == SPEC_LANE) & mask_m
        scored = mask_m if FOLLOW else spec  # rows whose scores over the base are stored
        # each row's first visible position (-1: no window), and the earliest over the lanes, lo
        ctx_len = base_tokens + tl.where(n_pages > n_base, (n_pages - n_base - 1) * G + last_ov, 0)
        row_first = tl.where(window >= 0, ctx_len - window - tl.where(lane == SPEC_LANE, 0, 1), -1)
        lo = tl.where(window >= 0, tl.maximum(ctx_len - window - (NLANES - 1), 0), 0)
        offs_d = tl.arange(0, D)
        offs_t = tl.arange(0, G)
        offs_k = tl.arange(0, BLOCK_K)
        q = tl.load(Q + rows[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_m[:, None], other=0.0)
        dot_dtype = tl.float32 if DOT_FP32 else Q.dtype.element_ty
        q = q.to(dot_dtype)
        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        r = tl.load(TOPK.req + b).to(tl.int64)
        if USE_TOPK:
            # row j of the request's top-k set: row j % TOPK_ROWS of frame table[r, j // TOPK_ROWS]
            tfr = tl.load(TOPK.table + r * TOPK.stride_table + offs_k // TOPK_ROWS, mask=offs_k < K,
                          other=0).to(tl.int64)
            trow = offs_k % TOPK_ROWS
            tpos = tl.load(TOPK.pos + tfr * TOPK.stride_pf + trow * TOPK.stride_pc + kvh * TOPK.stride_ph,
                           mask=offs_k < K, other=-1)
            usable = (tpos >= 0) & (tpos < base_tokens)
            tk_off = tfr * TOPK.stride_tf + trow * TOPK.stride_tc + kvh * TOPK.stride_th
        else:
            tpos = tl.full([BLOCK_K], -1, tl.int64)
            usable = offs_k < 0
            tk_off = tl.zeros([BLOCK_K], tl.int64)
        score_row = SCORES + (rows if FOLLOW else b) * stride_sb + heads * stride_sh

        if split == MAX_SPLITS:
            # 16-bit split: the prefetched rows (both lanes), then the speculative row's own K/V at index K
            kt = tl.load(TOPK.k + tk_off[None, :] + offs_d[:, None], mask=usable[None, :], other=0.0).to(tl.float32)
            v = tl.load(TOPK.v + tk_off[:, None] + offs_d[None, :], mask=usable[:, None], other=0.0).to(tl.float32)
            own_k = tl.load(KOWN + b * stride_kob + kvh * stride_koh + offs_d).to(tl.float32)
            own_v = tl.load(VOWN + b * stride_vob + kvh * stride_voh + offs_d).to(tl.float32)
            is_own = offs_k == K
            kt = tl.where(is_own[None, :], own_k[:, None], kt)
            v = tl.where(is_own[:, None], own_v[None, :], v)
            qk = _dot(q, kt.to(q.dtype), DOT_FP32) * sm_scale_log2
            seen = usable[None, :] & (tpos[None, :] >= row_first[:, None])
            valid = seen | (is_own[None, :] & spec[:, None])
            tl.store(score_row[:, None] + tpos[None, :], qk, mask=scored[:, None] & seen)
            m, l, acc = _softmax_step(qk, valid, m, l, acc, v.to(q.dtype), DOT_FP32)
            slot = 0
        else:
            u_lo = tl.where(lo < base_tokens, lo // G, n_base + (lo - base_tokens) // G)  # the unit holding lo
            per_split = tl.cdiv(n_pages - u_lo, ns)
            p_start = u_lo + split * per_split
            p_end = tl.minimum(p_start + per_split, n_pages)
            if USE_TOPK:
                # the membership test runs on every base page: over the K slots only (BLOCK_P = K padded), not the
                # 16-bit split's K + 1 (own row), which would double it at K = 64
                offs_p = tl.arange(0, BLOCK_P)
                pfr = tl.load(TOPK.table + r * TOPK.stride_table + offs_p // TOPK_ROWS, mask=offs_p < K,
                              other=0).to(tl.int64)
                mpos = tl.load(TOPK.pos + pfr * TOPK.stride_pf + (offs_p % TOPK_ROWS) * TOPK.stride_pc
                               + kvh * TOPK.stride_ph, mask=offs_p < K, other=-1)
                mpos = tl.where((mpos >= 0) & (mpos < base_tokens), mpos, -1)
            for j in range(p_start, tl.minimum(p_end, n_base)):
                page = tl.load(PAGES.kv_indices + kv_lo + j).to(tl.int64)
                n_valid = tl.where(j == n_base - 1, last_base, G)
                pos = j * G + offs_t
                valid = _window_valid(offs_t, j * G, n_valid, row_first[:, None])  # [BLOCK_M, G]
                if USE_TOPK:
                    replaced = tl.sum((pos[:, None] == mpos[None, :]).to(tl.int32), axis=1)
                    valid = valid & (replaced == 0)[None, :]
                kt = _page_kt(POOL, EXTRAS, page, kvh, n_heads, offs_t, offs_d, G, D, BITS[0], VG, CORRECT, SIZES)
                qk = _dot(q, kt.to(q.dtype), DOT_FP32) * sm_scale_log2
                tl.store(score_row[:, None] + pos[None, :], qk, mask=scored[:, None] & valid)
                v = _page_v(POOL, EXTRAS, page, kvh, n_heads, offs_t, offs_d, n_valid, G, D, BITS[1], VG, CORRECT,
                            SIZES)
                m, l, acc = _softmax_step(qk, valid, m, l, acc, v.to(q.dtype), DOT_FP32)
            for j in range(tl.maximum(p_start, n_base), p_end):
                frame = tl.load(PAGES.ov_indices + ov_lo + j - n_base).to(tl.int64)
                n_valid = tl.where(j == n_pages - 1, last_ov, G)
                valid = _window_valid(offs_t, base_tokens + (j - n_base) * G, n_valid, row_first[:, None])
                m, l, acc = _frame_step(q, m, l, acc, POOL, frame, n_valid, valid, kvh, offs_t, offs_d, sm_scale_log2,
                                        DOT_FP32)
            slot = split + 1

        has = l > 0.0
        o = acc / tl.where(has, l, 1.0)[:, None]
        lse = tl.where(has, (m + tl.log2(tl.where(has, l, 1.0))) * 0.6931471805599453, float("-inf"))
        o_off = (rows[:, None] * PARTS.stride_ob + heads[:, None] * PARTS.stride_oh + slot * PARTS.stride_os
                 + offs_d[None, :])
        tl.store(PARTS.o + o_off, o, mask=mask_m[:, None])
        tl.store(PARTS.lse + rows * PARTS.stride_lb + heads * PARTS.stride_lh + slot, lse, mask=mask_m)
