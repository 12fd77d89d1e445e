"""Jitted helpers shared by the decode and extend kernels: read one page of K/V (packed base page dequantized in
registers, or an fp16 overlay frame) and fold a tile of scores into an online softmax.

Packed codes: element d of a token-head row sits in byte d // (8 // BITS) at bit (d % (8 // BITS)) * BITS
(sgl_kvq.quant.pack). Keys dequantize per channel with the page's scale/zero, values per token and VG-channel group.
GEAR pages (RANK > 0) then get their correction in registers, in sgl_kvq.quant.gear_page.correct_keys' order: the
rank-RANK term u^T w, then each row's NK / NV outliers replace their entries. Correction buffers are contiguous
(kernels/checks.py): per page [P, H, RANK, G|D] and [P, H, NK, D], per slot [S, H, NV].
LogQuant pages (NROWS > 0) then have their stored fp16 rows replace the dequantized ones, in registers
(sgl_kvq.quant.logquant_page.apply_rows): k_rows, v_rows [P, NROWS, H, D] and row_off [P, NROWS] (255: empty),
contiguous (kernels/checks.py: rows_args).
zipcache2 pages (NSAL > 0) then get their salient rows in registers, in sgl_kvq.quant.zipcache_page.apply_salient's
order: each of the page's NSAL 4-bit rows replaces its token's row of K^T and of V, then V is multiplied by the
page's channel scale c. Salient buffers are contiguous (kernels/checks.py salient_args): [P, H, D], [P, H, NSAL],
[P, H, NSAL, D // 2], [P, H, NSAL, D // VG].
"""

import triton
import triton.language as tl


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    # fp32 operands are multiplied exactly ("ieee"), not in tf32: the fp32 path is the tight-tolerance oracle.
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _unpack(codes, offs_d, BITS: tl.constexpr):
    PB: tl.constexpr = 8 // BITS
    return ((codes.to(tl.int32) >> ((offs_d % PB) * BITS)) & ((1 << BITS) - 1)).to(tl.float32)


@triton.jit
def _base_page_kt(KC, KS, KZ, page, kvh, offs_t, offs_d, stride_kc_slot, stride_kc_head, stride_ks_page,
                  stride_ks_head, G: tl.constexpr, BITS: tl.constexpr):
    # -> K^T [D, G] fp32 of base page `page`, head kvh
    PB: tl.constexpr = 8 // BITS
    slots = page * G + offs_t
    codes = tl.load(KC + slots[None, :] * stride_kc_slot + kvh * stride_kc_head + (offs_d // PB)[:, None])
    ks = tl.load(KS + page * stride_ks_page + kvh * stride_ks_head + offs_d).to(tl.float32)
    kz = tl.load(KZ + page * stride_ks_page + kvh * stride_ks_head + offs_d).to(tl.float32)
    return _unpack(codes, offs_d[:, None], BITS) * ks[:, None] + kz[:, None]


@triton.jit
def _base_page_v(VC, VS, VZ, page, kvh, offs_t, offs_d, n_valid, stride_vc_slot, stride_vc_head,
                 stride_vs_slot, stride_vs_head, G: tl.constexpr, BITS: tl.constexpr, VG: tl.constexpr):
    # -> V [G, D] fp32 of base page `page`, head kvh; rows >= n_valid are 0, never loaded: a slot past the
    # context may hold garbage scales (NaN/inf), and p = 0 times NaN would still poison p @ V.
    PB: tl.constexpr = 8 // BITS
    slots = page * G + offs_t
    rows = (offs_t < n_valid)[:, None]
    codes = tl.load(VC + slots[:, None] * stride_vc_slot + kvh * stride_vc_head + (offs_d // PB)[None, :],
                    mask=rows, other=0)
    sz_off = slots[:, None] * stride_vs_slot + kvh * stride_vs_head + (offs_d // VG)[None, :]
    vs = tl.load(VS + sz_off, mask=rows, other=0.0).to(tl.float32)
    vz = tl.load(VZ + sz_off, mask=rows, other=0.0).to(tl.float32)
    return _unpack(codes, offs_d[None, :], BITS) * vs + vz


@triton.jit
def _correct_kt(kt, KU, KW, KOV, KOI, page, kvh, n_heads, offs_t, offs_d, G: tl.constexpr, D: tl.constexpr,
                RANK: tl.constexpr, NK: tl.constexpr):
    # kt [D, G] fp32 of base page `page`, head kvh -> with the page's GEAR correction
    ph = page * n_heads + kvh
    for j in tl.static_range(RANK):
        u = tl.load(KU + (ph * RANK + j) * G + offs_t).to(tl.float32)
        w = tl.load(KW + (ph * RANK + j) * D + offs_d).to(tl.float32)
        kt += w[:, None] * u[None, :]
    for j in tl.static_range(NK):
        tok = tl.load(KOI + (ph * NK + j) * D + offs_d).to(tl.int32)  # channel d's outlier sits at token tok[d]
        val = tl.load(KOV + (ph * NK + j) * D + offs_d).to(tl.float32)
        kt = tl.where(offs_t[None, :] == tok[:, None], val[:, None], kt)
    return kt


@triton.jit
def _correct_v(v, VU, VW, VOV, VOI, page, kvh, n_heads, offs_t, offs_d, n_valid, G: tl.constexpr,
               D: tl.constexpr, RANK: tl.constexpr, NV: tl.constexpr):
    # v [G, D] fp32 of base page `page`, head kvh -> with its GEAR correction; rows >= n_valid stay 0, never loaded
    ph = page * n_heads + kvh
    rows = offs_t < n_valid
    for j in tl.static_range(RANK):
        u = tl.load(VU + (ph * RANK + j) * G + offs_t, mask=rows, other=0.0).to(tl.float32)
        w = tl.load(VW + (ph * RANK + j) * D + offs_d).to(tl.float32)
        v += u[:, None] * w[None, :]
    slot_heads = (page * G + offs_t) * n_heads + kvh
    for j in tl.static_range(NV):
        ch = tl.load(VOI + slot_heads * NV + j, mask=rows, other=0).to(tl.int32)
        val = tl.load(VOV + slot_heads * NV + j, mask=rows, other=0.0).to(tl.float32)
        v = tl.where((offs_d[None, :] == ch[:, None]) & rows[:, None], val[:, None], v)
    return v


@triton.jit
def _replace_rows_kt(kt, KR, RO, page, kvh, n_heads, offs_t, offs_d, D: tl.constexpr, NROWS: tl.constexpr):
    # kt [D, G] fp32 of base page `page`, head kvh -> with the page's stored fp16 key rows in their columns
    for j in tl.static_range(NROWS):
        off = tl.load(RO + page * NROWS + j).to(tl.int32)  # 255 (empty) matches no offset
        row = tl.load(KR + ((page * NROWS + j) * n_heads + kvh) * D + offs_d).to(tl.float32)
        kt = tl.where(offs_t[None, :] == off, row[:, None], kt)
    return kt


@triton.jit
def _salient_kt(kt, SI, SKC, SKS, SKZ, page, kvh, n_heads, offs_t, offs_d, D: tl.constexpr, NSAL: tl.constexpr):
    # kt [D, G] fp32 of base page `page`, head kvh -> with its salient tokens' 4-bit keys in their columns
    ph = page * n_heads + kvh
    ks = tl.load(SKS + ph * D + offs_d).to(tl.float32)
    kz = tl.load(SKZ + ph * D + offs_d).to(tl.float32)
    for j in range(NSAL):
        tok = tl.load(SI + ph * NSAL + j).to(tl.int32)
        codes = tl.load(SKC + (ph * NSAL + j) * (D // 2) + offs_d // 2)
        row = _unpack(codes, offs_d, 4) * ks + kz
        kt = tl.where(offs_t[None, :] == tok, row[:, None], kt)
    return kt


@triton.jit
def _replace_rows_v(v, VR, RO, page, kvh, n_heads, offs_t, offs_d, n_valid, D: tl.constexpr,
                    NROWS: tl.constexpr):
    # v [G, D] fp32 of base page `page`, head kvh -> with its stored fp16 value rows; rows >= n_valid stay 0
    for j in tl.static_range(NROWS):
        off = tl.load(RO + page * NROWS + j).to(tl.int32)
        row = tl.load(VR + ((page * NROWS + j) * n_heads + kvh) * D + offs_d).to(tl.float32)
        v = tl.where(((offs_t == off) & (offs_t < n_valid))[:, None], row[None, :], v)
    return v


@triton.jit
def _salient_v(v, VCH, SI, SVC, SVS, SVZ, page, kvh, n_heads, offs_t, offs_d, n_valid, D: tl.constexpr,
               VG: tl.constexpr, NSAL: tl.constexpr):
    # v [G, D] fp32 (V / c) of base page `page`, head kvh -> its salient rows replaced, times c; rows >= n_valid
    # stay 0
    NG: tl.constexpr = D // VG
    ph = page * n_heads + kvh
    rows = offs_t < n_valid
    for j in range(NSAL):
        tok = tl.load(SI + ph * NSAL + j).to(tl.int32)
        codes = tl.load(SVC + (ph * NSAL + j) * (D // 2) + offs_d // 2)
        vs = tl.load(SVS + (ph * NSAL + j) * NG + offs_d // VG).to(tl.float32)
        vz = tl.load(SVZ + (ph * NSAL + j) * NG + offs_d // VG).to(tl.float32)
        row = _unpack(codes, offs_d, 4) * vs + vz
        v = tl.where((offs_t[:, None] == tok) & rows[:, None], row[None, :], v)
    c = tl.load(VCH + ph * D + offs_d).to(tl.float32)
    return v * c[None, :]


@triton.jit
def _softmax_step(qk, valid, m, l, acc, v, DOT_FP32: tl.constexpr):
    # qk [M, N] scores already in log2 units, valid [M, N] bool; v [N, D] -> updated (m, l, acc).
    # Every caller's first tile has a valid key in every row, so m is finite after it and alpha never sees
    # (-inf) - (-inf).
    qk = tl.where(valid, qk, float("-inf"))
    m_new = tl.maximum(m, tl.max(qk, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_FP32)
    return m_new, l, acc


@triton.jit
def _base_page_step(q, m, l, acc, KC, KS, KZ, VC, VS, VZ, KU, KW, VU, VW, KOV, KOI, VOV, VOI, KR, VR, RO,
                    VCH, SI, SKC, SKS, SKZ, SVC, SVS, SVZ, page, n_valid, kvh, n_heads, offs_t, offs_d,
                    stride_kc_slot, stride_kc_head, stride_ks_page, stride_ks_head, stride_vs_slot, stride_vs_head,
                    sm_scale_log2, G: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, VG: tl.constexpr,
                    RANK: tl.constexpr, NK: tl.constexpr, NV: tl.constexpr, NROWS: tl.constexpr, NSAL: tl.constexpr,
                    DOT_FP32: tl.constexpr):
    # One packed base page into the online softmax of q [M, D] (already in the dot dtype): -> updated (m, l, acc).
    kt = _base_page_kt(KC, KS, KZ, page, kvh, offs_t, offs_d, stride_kc_slot, stride_kc_head,
                       stride_ks_page, stride_ks_head, G, BITS)
    if RANK > 0:
        kt = _correct_kt(kt, KU, KW, KOV, KOI, page, kvh, n_heads, offs_t, offs_d, G, D, RANK, NK)
    if NROWS > 0:
        kt = _replace_rows_kt(kt, KR, RO, page, kvh, n_heads, offs_t, offs_d, D, NROWS)
    if NSAL > 0:
        kt = _salient_kt(kt, SI, SKC, SKS, SKZ, page, kvh, n_heads, offs_t, offs_d, D, NSAL)
    qk = _dot(q, kt.to(q.dtype), DOT_FP32) * sm_scale_log2
    v = _base_page_v(VC, VS, VZ, page, kvh, offs_t, offs_d, n_valid, stride_kc_slot,
                     stride_kc_head, stride_vs_slot, stride_vs_head, G, BITS, VG)
    if RANK > 0:
        v = _correct_v(v, VU, VW, VOV, VOI, page, kvh, n_heads, offs_t, offs_d, n_valid, G, D, RANK, NV)
    if NROWS > 0:
        v = _replace_rows_v(v, VR, RO, page, kvh, n_heads, offs_t, offs_d, n_valid, D, NROWS)
    if NSAL > 0:
        v = _salient_v(v, VCH, SI, SVC, SVS, SVZ, page, kvh, n_heads, offs_t, offs_d, n_valid, D, VG, NSAL)
    return _softmax_step(qk, (offs_t < n_valid)[None, :], m, l, acc, v.to(q.dtype), DOT_FP32)


@triton.jit
def _frame_step(q, m, l, acc, OVK, OVV, frame, n_valid, kvh, offs_t, offs_d, stride_ov_frame, stride_ov_head,
                stride_ov_tok, sm_scale_log2, DOT_FP32: tl.constexpr):
    # One fp16 overlay frame into the online softmax of q [M, D]: -> updated (m, l, acc).
    base = frame * stride_ov_frame + kvh * stride_ov_head
    kt = tl.load(OVK + base + offs_t[None, :] * stride_ov_tok + offs_d[:, None])
    qk = _dot(q, kt.to(q.dtype), DOT_FP32) * sm_scale_log2
    # rows past the frame's last token are never loaded: they may hold NaN (see _base_page_v)
    v = tl.load(OVV + base + offs_t[:, None] * stride_ov_tok + offs_d[None, :],
                mask=(offs_t < n_valid)[:, None], other=0.0)
    return _softmax_step(qk, (offs_t < n_valid)[None, :], m, l, acc, v.to(q.dtype), DOT_FP32)
