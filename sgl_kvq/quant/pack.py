"""Bit packing of b-bit codes into uint8 along the last dimension.

Layout (the one every kernel, the pool and the references share):
    codes  [..., N]          uint8 values in [0, 2**b)
    packed [..., N * b // 8]  uint8; element i lives in byte i // (8 // b) at bit offset (i % (8 // b)) * b
                              (little-endian inside the byte: element 0 in the low bits).
b = 8 is the identity. N must be a multiple of 8 // b.

b = 3 (kivi3) is two planes of that layout, one after the other in the row, so every reader unpacks a power-of-two
width twice:
    packed [..., N * 3 // 8] = [ low plane: codes & 3 at 2 bits, N // 4 bytes | high plane: codes >> 2 at 1 bit,
                                 N // 8 bytes ]
    code = low | high << 2.  N must be a multiple of 8.
A bit stream (code i at bit 3i, sgl_kvq.quant.bitpack) takes as many bytes, but its codes straddle byte boundaries
and no power-of-two unpack reads it.
"""

from __future__ import annotations

import torch

PACK_BITS = (1, 2, 3, 4, 8)
# b = 3: the (low, high) planes' widths, in the row's order
PLANES_3 = (2, 1)
_WORD = {8: torch.int64, 4: torch.int32, 2: torch.int16}  # codes per byte -> the word holding that many bytes


def per_byte(bits: int) -> int:
    """Codes per byte of a power-of-two width (a 3-bit row is two planes of these, see the module doc)."""
    if bits not in PACK_BITS or bits == 3:
        raise ValueError(f"no whole number of {bits}-bit codes per byte; supported: 1, 2, 4, 8")
    return 8 // bits


def packed_dim(n: int, bits: int) -> int:
    if bits == 3:
        if n % 8:
            raise ValueError(f"last dim {n} is not a multiple of 8 (a 3-bit row's 1-bit plane)")
        return sum(packed_dim(n, b) for b in PLANES_3)
    if bits not in PACK_BITS:
        raise ValueError(f"cannot pack {bits}-bit codes; supported: {PACK_BITS}")
    k = per_byte(bits)
    if n % k:
        raise ValueError(f"last dim {n} is not a multiple of {k} ({bits}-bit codes per byte)")
    return n // k


def low_plane_bytes(n: int) -> int:
    """A 3-bit row of n codes: bytes of its low (2-bit) plane, where the high (1-bit) plane starts."""
    packed_dim(n, 3)
    return n // 4


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., N] uint8 codes -> [..., N * bits // 8] uint8."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    n = codes.shape[-1]
    packed_dim(n, bits)
    if bits == 3:
        return torch.cat([pack(codes & 3, 2), pack(codes >> 2, 1)], -1)
    k = per_byte(bits)
    if k == 1:
        return codes.clone()
    # The k codes of one output byte, read as one little-endian word (byte i = code i at bit 8i), are moved to bit
    # b*i by OR-ing the word shifted right by (8 - b)*i: code i lands at b*i, every other code falls outside the low
    # byte (codes < 2**b). One pass per shift over n // k words instead of int32 codes, shifts and a strided sum
    # (64 pages of SmolLM2 keys, one thread: 1.37 -> 0.20 ms at 2 bits, 3.5 -> 0.07 ms at 4, 1.04 -> 0.32 at 1).
    codes = codes.contiguous()
    if codes.storage_offset() % k:  # a word view needs word-aligned storage
        codes = codes.clone()
    words = codes.view(_WORD[k])
    out = words.clone()
    for i in range(1, k):
        out |= words >> ((8 - bits) * i)
    return out.to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., M] uint8 -> [..., M * 8 // bits] uint8 codes (inverse of pack)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed codes must be uint8, got {packed.dtype}")
    if bits == 3:
        if packed.shape[-1] % 3:
            raise ValueError(f"a 3-bit row is a whole number of 3-byte groups, got {packed.shape[-1]} bytes")
        lo = 2 * packed.shape[-1] // 3  # low plane bytes: N // 4 of the row's 3N // 8
        return unpack(packed[..., :lo], 2) | (unpack(packed[..., lo:], 1) << 2)
    k = per_byte(bits)
    if k == 1:
        return packed.clone()
    shifts = torch.arange(k, device=packed.device, dtype=torch.int32) * bits
    mask = (1 << bits) - 1
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & mask
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * k).to(torch.uint8)
