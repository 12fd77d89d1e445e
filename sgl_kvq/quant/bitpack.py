"""Bit-stream packing of b-bit codes, any b in 1..8, along the last dimension.

Layout: one little-endian bit stream per row; element i occupies bits [i*b, (i+1)*b) of the stream, byte j holds bits
[8j, 8j+8). For b in {1, 2, 4, 8} this is exactly sgl_kvq.quant.pack's layout (element i in byte i // (8 // b) at bit
offset (i % (8 // b)) * b); for b = 3 it is the layout vLLM's TurboQuant store kernel writes (8 codes -> 24 bits ->
3 bytes, code i at bit 3i). Used where pack.py's widths do not reach: KIVI at 3 bits, TurboQuant's 3-bit indices.
N * b must be a multiple of 8 (whole bytes per row).
"""

from __future__ import annotations

import torch


def packed_bytes(n: int, bits: int) -> int:
    if not 1 <= bits <= 8:
        raise ValueError(f"bits must be in 1..8, got {bits}")
    if (n * bits) % 8:
        raise ValueError(f"{n} codes of {bits} bits do not fill whole bytes")
    return n * bits // 8


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., N] uint8 codes < 2**bits -> [..., N * bits // 8] uint8."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    n = codes.shape[-1]
    nbytes = packed_bytes(n, bits)
    if bits == 8:
        return codes.clone()
    # 8 codes make `bits` whole bytes: build each 8-code word (<= 56 bits) in int64, then cut it into bytes
    lead = codes.shape[:-1]
    per = 8 if n % 8 == 0 else 8 // bits  # widths dividing 8 also work on shorter rows
    words = codes.reshape(*lead, n // per, per).to(torch.int64)
    shifts = torch.arange(per, dtype=torch.int64) * bits
    word = (words << shifts).sum(-1)
    wbytes = per * bits // 8
    out = (word.unsqueeze(-1) >> (torch.arange(wbytes, dtype=torch.int64) * 8)) & 0xFF
    return out.reshape(*lead, nbytes).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """[..., n * bits // 8] uint8 -> [..., n] uint8 codes (inverse of pack_bits)."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed codes must be uint8, got {packed.dtype}")
    nbytes = packed_bytes(n, bits)
    if packed.shape[-1] != nbytes:
        raise ValueError(f"expected {nbytes} bytes per row for {n} codes of {bits} bits, got {packed.shape[-1]}")
    if bits == 8:
        return packed.clone()
    lead = packed.shape[:-1]
    per = 8 if n % 8 == 0 else 8 // bits
    wbytes = per * bits // 8
    b = packed.reshape(*lead, n // per, wbytes).to(torch.int64)
    word = (b << (torch.arange(wbytes, dtype=torch.int64) * 8)).sum(-1)
    codes = (word.unsqueeze(-1) >> (torch.arange(per, dtype=torch.int64) * bits)) & ((1 << bits) - 1)
    return codes.reshape(*lead, n).to(torch.uint8)
