"""Jitted unpacking of b-bit codes, shared by the base pages and the formats' extras: element d of a row sits in byte
d // (8 // BITS) at bit (d % (8 // BITS)) * BITS (sgl_kvq.quant.pack). A 3-bit row of D elements is two such rows,
a 2-bit plane (bytes 0 .. D/4 - 1) then a 1-bit plane (bytes D/4 .. 3D/8 - 1): code = low | high << 2."""

import triton
import triton.language as tl


@triton.jit
def _unpack(codes, offs_d, BITS: tl.constexpr):
    # codes: the bytes holding elements offs_d -> their codes as fp32
    PB: tl.constexpr = 8 // BITS
    return ((codes.to(tl.int32) >> ((offs_d % PB) * BITS)) & ((1 << BITS) - 1)).to(tl.float32)


@triton.jit
def _unpack3(low, high, offs_d):
    # a 3-bit row's bytes holding elements offs_d in its 2-bit plane (low) and its 1-bit plane (high) -> codes fp32
    return _unpack(low, offs_d, 2) + 4.0 * _unpack(high, offs_d, 1)
