"""Uniform asymmetric b-bit quantization over a group: x ~= zero + code * scale.

One formula for every bit width, so a kernel dequantizes with one fused multiply-add whatever b is:
- b in {2, 4, 8}: zero = min, scale = (max - min) / (2**b - 1)      (KIVI, FlexGen)
- b = 1, SpeCache (eq. 3): zero = (3 min + max) / 4, scale = (max - min) / 2: the two levels sit at the quarter
  points of [min, max] instead of on its ends, which halves the worst-case error of plain 1-bit min/max.
- b = 1, plain: zero = min, scale = max - min (the baseline the SpeCache form is compared against).
scale and zero are stored as fp16; codes are computed against the stored fp16 values, so dequantization of what is
stored reproduces exactly what the quantizer meant.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

SCALE_DTYPE = torch.float16
_TINY = 1e-6  # a constant group (max == min) gets this scale; its codes are all 0 and zero carries the value


class Quantized(NamedTuple):
    codes: torch.Tensor  # uint8, same shape as x, values in [0, 2**bits)
    scale: torch.Tensor  # fp16, x's shape with the reduced dims kept as size 1
    zero: torch.Tensor  # fp16, like scale


def levels(bits: int) -> int:
    return (1 << bits) - 1


def scale_zero(lo: torch.Tensor, hi: torch.Tensor, bits: int, *, specache_one_bit: bool = True):
    lo = lo.float()
    hi = hi.float()
    if bits == 1 and specache_one_bit:
        zero, scale = (3 * lo + hi) / 4, (hi - lo) / 2
    else:
        zero, scale = lo, (hi - lo) / levels(bits)
    scale = torch.where(scale > _TINY, scale, torch.full_like(scale, _TINY))
    return scale.clamp(max=65504).to(SCALE_DTYPE), zero.clamp(-65504, 65504).to(SCALE_DTYPE)


def encode(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int) -> torch.Tensor:
    # in place on one temporary: the same roundings as round((x - zero) / scale), without three x-sized allocations
    q = x.float() - zero.float()
    return q.div_(scale.float()).round_().clamp_(0, levels(bits)).to(torch.uint8)


def quantize(x: torch.Tensor, bits: int, dims, *, specache_one_bit: bool = True) -> Quantized:
    """Quantize x with one (scale, zero) per slice over `dims` (reduced dims are kept as size 1)."""
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    xf = x.float()
    lo = xf.amin(dim=dims, keepdim=True)
    hi = xf.amax(dim=dims, keepdim=True)
    scale, zero = scale_zero(lo, hi, bits, specache_one_bit=specache_one_bit)
    return Quantized(encode(xf, scale, zero, bits), scale, zero)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (codes.float() * scale.float() + zero.float()).to(dtype)


def quantize_channel_groups(x: torch.Tensor, bits: int, group: int, *, specache_one_bit: bool = True) -> Quantized:
    """Per-vector quantization in groups of `group` consecutive channels of the last dim.

    Returns codes shaped like x and scale/zero shaped [..., D // group]."""
    d = x.shape[-1]
    if d % group:
        raise ValueError(f"last dim {d} is not a multiple of the channel group {group}")
    q = quantize(x.reshape(*x.shape[:-1], d // group, group), bits, -1, specache_one_bit=specache_one_bit)
    return Quantized(q.codes.reshape(x.shape), q.scale.squeeze(-1), q.zero.squeeze(-1))


def dequantize_channel_groups(codes, scale, zero, dtype=torch.float32) -> torch.Tensor:
    d = codes.shape[-1]
    g = d // scale.shape[-1]
    grouped = codes.reshape(*codes.shape[:-1], d // g, g)
    return dequantize(grouped, scale.unsqueeze(-1), zero.unsqueeze(-1), dtype).reshape(codes.shape)
