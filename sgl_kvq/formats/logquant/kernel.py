"""Jitted LogQuant rows (logquant2): a page's stored fp16 rows replace the dequantized ones, as
sgl_kvq.formats.logquant.codec.apply_rows does. X is a PageRows of contiguous tensors (formats/logquant/
logquant_shapes): k_rows, v_rows [P, M, H, D] and row_off [P, M] (255: an empty slot, which matches no offset).
SIZES = (M,)."""

import triton
import triton.language as tl


@triton.jit
def _logquant_kt(kt, X, page, kvh, n_heads, offs_t, offs_d, G: tl.constexpr, D: tl.constexpr, VG: tl.constexpr,
                 SIZES: tl.constexpr):
    # kt [D, G] fp32 of base page `page`, head kvh -> with the page's stored fp16 key rows in their columns
    NROWS: tl.constexpr = SIZES[0]
    for j in tl.static_range(NROWS):
        off = tl.load(X.row_off + page * NROWS + j).to(tl.int32)
        row = tl.load(X.k_rows + ((page * NROWS + j) * n_heads + kvh) * D + offs_d).to(tl.float32)
        kt = tl.where(offs_t[None, :] == off, row[:, None], kt)
    return kt


@triton.jit
def _logquant_v(v, X, page, kvh, n_heads, offs_t, offs_d, n_valid, G: tl.constexpr, D: tl.constexpr,
                VG: tl.constexpr, SIZES: tl.constexpr):
    # v [G, D] fp32 of base page `page`, head kvh -> with its stored fp16 value rows; rows >= n_valid stay 0
    NROWS: tl.constexpr = SIZES[0]
    for j in tl.static_range(NROWS):
        off = tl.load(X.row_off + page * NROWS + j).to(tl.int32)
        row = tl.load(X.v_rows + ((page * NROWS + j) * n_heads + kvh) * D + offs_d).to(tl.float32)
        v = tl.where(((offs_t == off) & (offs_t < n_valid))[:, None], row[None, :], v)
    return v


# what the kernels call (KernelVariant.corrections)
CORRECT = (_logquant_kt, _logquant_v)
