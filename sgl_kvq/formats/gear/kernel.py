"""Jitted GEAR correction (gear2, gearl2), in sgl_kvq.formats.gear.codec.correct_keys / correct_values' order: the
rank-r term u^T w, then each row's outliers replace their entries. X is a PageCorrection of contiguous tensors
(formats/gear/ gear_shapes): k_u, v_u [P, H, r, G]; k_w, v_w [P, H, r, D]; k_out_* [P, H, NK, D]; v_out_* [S, H, NV].
SIZES = (r, NK, NV)."""

import triton
import triton.language as tl


@triton.jit
def _gear_kt(kt, X, page, kvh, n_heads, offs_t, offs_d, G: tl.constexpr, D: tl.constexpr, VG: tl.constexpr,
             SIZES: tl.constexpr):
    # kt [D, G] fp32 of base page `page`, head kvh -> with the page's GEAR correction
    RANK: tl.constexpr = SIZES[0]
    NK: tl.constexpr = SIZES[1]
    ph = page * n_heads + kvh
    for j in tl.static_range(RANK):
        u = tl.load(X.k_u + (ph * RANK + j) * G + offs_t).to(tl.float32)
        w = tl.load(X.k_w + (ph * RANK + j) * D + offs_d).to(tl.float32)
        kt += w[:, None] * u[None, :]
    for j in tl.static_range(NK):
        tok = tl.load(X.k_out_idx + (ph * NK + j) * D + offs_d).to(tl.int32)  # channel d's outlier: token tok[d]
        val = tl.load(X.k_out_val + (ph * NK + j) * D + offs_d).to(tl.float32)
        kt = tl.where(offs_t[None, :] == tok[:, None], val[:, None], kt)
    return kt


@triton.jit
def _gear_v(v, X, page, kvh, n_heads, offs_t, offs_d, n_valid, G: tl.constexpr, D: tl.constexpr, VG: tl.constexpr,
            SIZES: tl.constexpr):
    # v [G, D] fp32 of base page `page`, head kvh -> with its GEAR correction; rows >= n_valid stay 0, never loaded
    RANK: tl.constexpr = SIZES[0]
    NV: tl.constexpr = SIZES[2]
    ph = page * n_heads + kvh
    rows = offs_t < n_valid
    for j in tl.static_range(RANK):
        u = tl.load(X.v_u + (ph * RANK + j) * G + offs_t, mask=rows, other=0.0).to(tl.float32)
        w = tl.load(X.v_w + (ph * RANK + j) * D + offs_d).to(tl.float32)
        v += u[:, None] * w[None, :]
    slot_heads = (page * G + offs_t) * n_heads + kvh
    for j in tl.static_range(NV):
        ch = tl.load(X.v_out_idx + slot_heads * NV + j, mask=rows, other=0).to(tl.int32)
        val = tl.load(X.v_out_val + slot_heads * NV + j, mask=rows, other=0.0).to(tl.float32)
        v = tl.where((offs_d[None, :] == ch[:, None]) & rows[:, None], val[:, None], v)
    return v


# what the kernels call (KernelVariant.corrections)
CORRECT = (_gear_kt, _gear_v)
