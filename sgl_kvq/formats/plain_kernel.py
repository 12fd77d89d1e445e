"""KIVI's pages as stored: the jitted corrections of a format that adds nothing to its base pages (KIVI_KERNEL,
sgl_kvq/formats/kernel_variant.py), with the signature every format's corrections have: K^T [D, G] and V [G, D]
fp32 of base page `page`, head kvh, in and out (sgl_kvq/kernels/paged_kv_kernel.py calls them)."""

import triton
import triton.language as tl


@triton.jit
def _plain_kt(kt, X, page, kvh, n_heads, offs_t, offs_d, G: tl.constexpr, D: tl.constexpr, VG: tl.constexpr,
              SIZES: tl.constexpr):
    return kt


@triton.jit
def _plain_v(v, X, page, kvh, n_heads, offs_t, offs_d, n_valid, G: tl.constexpr, D: tl.constexpr, VG: tl.constexpr,
             SIZES: tl.constexpr):
    return v


# what the kernels call (KernelVariant.corrections)
CORRECT = (_plain_kt, _plain_v)
