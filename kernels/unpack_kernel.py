"""Jitted unpacking of b-bit codes, shared by the base pages and the formats' extras: element d of a row sits in byte
d // (8 // BITS) at bit (d % (8 // BITS)) * BITS (sgl_kvq.quant.pack)."""

import triton
import triton.language as tl


@triton.jit
def _unpack(codes, offs_d, BITS: tl.constexpr):
    # codes: the bytes holding elements offs_d -> their codes as fp32
    PB: tl.constexpr = 8 // BITS
    return ((codes.to(tl.int32) >> ((offs_d % PB) * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
