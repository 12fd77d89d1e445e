"""Jitted ZipCache salient plane (zipcache2), in sgl_kvq.formats.zipcache.codec.apply_salient's order: each of the
page's NS salient rows, at SBITS bits, replaces its token's row of K^T and of V, then V (stored as V / c) is
multiplied by the page's channel scale c. X is a SalientPlane of contiguous tensors (formats/zipcache/
zipcache_shapes): v_chan, s_k_scale, s_k_zero [P, H, D]; s_idx [P, H, NS]; s_k_codes, s_v_codes
[P, H, NS, D * SBITS // 8]; s_v_scale, s_v_zero [P, H, NS, D // VG]. SIZES = (NS, SBITS)."""

import triton
import triton.language as tl

from sgl_kvq.quant.unpack_kernel import _unpack


@triton.jit
def _zipcache_kt(kt, X, page, kvh, n_heads, offs_t, offs_d, G: tl.constexpr, D: tl.constexpr, VG: tl.constexpr,
                 SIZES: tl.constexpr):
    # kt [D, G] fp32 of base page `page`, head kvh -> with its salient tokens' keys in their columns
    NSAL: tl.constexpr = SIZES[0]
    SBITS: tl.constexpr = SIZES[1]
    DS: tl.constexpr = D * SBITS // 8
    ph = page * n_heads + kvh
    ks = tl.load(X.s_k_scale + ph * D + offs_d).to(tl.float32)
    kz = tl.load(X.s_k_zero + ph * D + offs_d).to(tl.float32)
    for j in range(NSAL):
        tok = tl.load(X.s_idx + ph * NSAL + j).to(tl.int32)
        codes = tl.load(X.s_k_codes + (ph * NSAL + j) * DS + offs_d // (8 // SBITS))
        row = _unpack(codes, offs_d, SBITS) * ks + kz
        kt = tl.where(offs_t[None, :] == tok, row[:, None], kt)
    return kt


@triton.jit
def _zipcache_v(v, X, page, kvh, n_heads, offs_t, offs_d, n_valid, G: tl.constexpr, D: tl.constexpr,
                VG: tl.constexpr, SIZES: tl.constexpr):
    # v [G, D] fp32 (V / c) of base page `page`, head kvh -> its salient rows replaced, times c; rows >= n_valid
    # stay 0
    NSAL: tl.constexpr = SIZES[0]
    SBITS: tl.constexpr = SIZES[1]
    DS: tl.constexpr = D * SBITS // 8
    NG: tl.constexpr = D // VG
    ph = page * n_heads + kvh
    rows = offs_t < n_valid
    for j in range(NSAL):
        tok = tl.load(X.s_idx + ph * NSAL + j).to(tl.int32)
        codes = tl.load(X.s_v_codes + (ph * NSAL + j) * DS + offs_d // (8 // SBITS))
        vs = tl.load(X.s_v_scale + (ph * NSAL + j) * NG + offs_d // VG).to(tl.float32)
        vz = tl.load(X.s_v_zero + (ph * NSAL + j) * NG + offs_d // VG).to(tl.float32)
        row = _unpack(codes, offs_d, SBITS) * vs + vz
        v = tl.where((offs_t[:, None] == tok) & rows[:, None], row[None, :], v)
    c = tl.load(X.v_chan + ph * D + offs_d).to(tl.float32)
    return v * c[None, :]


# what the kernels call (KernelVariant.corrections)
CORRECT = (_zipcache_kt, _zipcache_v)
