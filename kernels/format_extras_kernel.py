"""Jitted format extras: what a format adds to KIVI's page, applied in registers to the dequantized base page
(K^T [D, G] before the scores, V [G, D] before p @ V), selected by the FORMAT constexpr.

EXTRAS is the format's page tensors (a named tuple, format_extras.py: checked contiguous in the shapes its format
declares), SIZES its sizes in Format.page_shapes' keyword order. Each format's correction is one jitted function per
operand, in <format>_extras_kernel.py, with the signature of _apply_extras_k / _apply_extras_v less FORMAT. With
FORMAT "" (plain KIVI pages) both are the identity and EXTRAS is ().
"""

import triton
import triton.language as tl

from .gear_extras_kernel import _gear_kt, _gear_v
from .logquant_extras_kernel import _logquant_kt, _logquant_v
from .zipcache_extras_kernel import _zipcache_kt, _zipcache_v


@triton.jit
def _apply_extras_k(kt, EXTRAS, page, kvh, n_heads, offs_t, offs_d, G: tl.constexpr, D: tl.constexpr,
                    VG: tl.constexpr, FORMAT: tl.constexpr, SIZES: tl.constexpr):
    # kt [D, G] fp32 of base page `page`, head kvh -> as the format reads it
    if FORMAT == "gear":
        kt = _gear_kt(kt, EXTRAS, page, kvh, n_heads, offs_t, offs_d, G, D, VG, SIZES)
    elif FORMAT == "logquant":
        kt = _logquant_kt(kt, EXTRAS, page, kvh, n_heads, offs_t, offs_d, G, D, VG, SIZES)
    elif FORMAT == "zipcache":
        kt = _zipcache_kt(kt, EXTRAS, page, kvh, n_heads, offs_t, offs_d, G, D, VG, SIZES)
    return kt


@triton.jit
def _apply_extras_v(v, EXTRAS, page, kvh, n_heads, offs_t, offs_d, n_valid, G: tl.constexpr, D: tl.constexpr,
                    VG: tl.constexpr, FORMAT: tl.constexpr, SIZES: tl.constexpr):
    # v [G, D] fp32 of base page `page`, head kvh (rows >= n_valid are 0) -> as the format reads it, those rows
    # still 0: nothing past the context is loaded
    if FORMAT == "gear":
        v = _gear_v(v, EXTRAS, page, kvh, n_heads, offs_t, offs_d, n_valid, G, D, VG, SIZES)
    elif FORMAT == "logquant":
        v = _logquant_v(v, EXTRAS, page, kvh, n_heads, offs_t, offs_d, n_valid, G, D, VG, SIZES)
    elif FORMAT == "zipcache":
        v = _zipcache_v(v, EXTRAS, page, kvh, n_heads, offs_t, offs_d, n_valid, G, D, VG, SIZES)
    return v
