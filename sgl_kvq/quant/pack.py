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
    grouped = codes.reshape(*codes.shape[:-1], n // k, k).to(torch.int32)
    shifts = torch.arange(k, device=codes.device, dtype=torch.int32) * bits
    return (grouped << shifts).sum(-1).to(torch.uint8)


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
