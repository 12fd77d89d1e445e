"""KIVI on one page of G tokens: the exact format of the pool's base (see sgl_kvq/layout.py).

Keys are quantized per channel over the page's G tokens (KIVI: key outliers live in fixed channels, so a per-channel
range absorbs them); values per token in groups of VG channels. These functions are the torch reference of the
quantize-and-pack kernel and of every dequantizing read.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl_kvq.quant import pack, uniform


class PackedPages(NamedTuple):
    k_codes: torch.Tensor  # [N, G, H, Dp] uint8
    k_scale: torch.Tensor  # [N, H, D] fp16
    k_zero: torch.Tensor  # [N, H, D] fp16
    v_codes: torch.Tensor  # [N, G, H, Dp] uint8
    v_scale: torch.Tensor  # [N, G, H, D // VG] fp16
    v_zero: torch.Tensor  # [N, G, H, D // VG] fp16


def pack_pages(k: torch.Tensor, v: torch.Tensor, bits: int, value_group: int, *,
               specache_one_bit: bool = True, v_bits: int | None = None) -> PackedPages:
    """k, v: [N, G, H, D] (N complete pages) -> the packed base of those pages, keys at `bits`, values at `v_bits`
    (None: `bits`), returned (its kernel twin, kernels.quantize_pages.quantize_pages, writes them into the pool in
    place)."""
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"expected k, v [N, G, H, D] of one shape, got {tuple(k.shape)} {tuple(v.shape)}")
    kq = uniform.quantize(k, bits, dims=1, specache_one_bit=specache_one_bit)  # reduce over the G tokens
    v_bits = v_bits or bits
    vq = uniform.quantize_channel_groups(v, v_bits, value_group, specache_one_bit=specache_one_bit)
    return PackedPages(
        pack.pack(kq.codes, bits), kq.scale.squeeze(1), kq.zero.squeeze(1),
        pack.pack(vq.codes, v_bits), vq.scale, vq.zero,
    )


def dequantize_keys(k_codes, k_scale, k_zero, bits: int, dtype=torch.float32) -> torch.Tensor:
    """[N, G, H, Dp] codes with [N, H, D] scale/zero -> [N, G, H, D]."""
    codes = pack.unpack(k_codes, bits)
    return uniform.dequantize(codes, k_scale.unsqueeze(1), k_zero.unsqueeze(1), dtype)


def dequantize_values(v_codes, v_scale, v_zero, bits: int, dtype=torch.float32) -> torch.Tensor:
    """[..., H, Dp] codes with [..., H, D // VG] scale/zero -> [..., H, D]."""
    return uniform.dequantize_channel_groups(pack.unpack(v_codes, bits), v_scale, v_zero, dtype)


def dequantize_pages(p: PackedPages, bits: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    return (dequantize_keys(p.k_codes, p.k_scale, p.k_zero, bits, dtype),
            dequantize_values(p.v_codes, p.v_scale, p.v_zero, bits, dtype))
