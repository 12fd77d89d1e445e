"""The one result type every reference KV format returns, so evaluation and byte accounting treat them alike.

`stored` holds every tensor the format keeps, exactly as it would sit in memory (packed uint8 codes, fp16
scales/zeros, fp16 tokens, fp16 low-rank factors, fp16 sparse values with int32 indices ...). Names start with
"k." for what belongs to the keys and "v." for the values; bench.quant.accounting counts bytes from these tensors
only, never from a formula, and k_hat/v_hat are rebuilt from them, so the two cannot drift apart.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class CompressedKV(NamedTuple):
    k_hat: torch.Tensor  # [T, H, D] fp32: the keys attention reads back
    v_hat: torch.Tensor  # [T, H, D] fp32
    stored: dict[str, torch.Tensor]  # "k.*" / "v.*" -> the tensors actually kept
    kept: torch.Tensor | None = None  # [T, H] bool: tokens held above the base precision (fp16 or 4-bit salient)


def fp16(x: torch.Tensor) -> torch.Tensor:
    """What an fp16 copy of x reads back as (fp32)."""
    return x.to(torch.float16).float()


def check_kv(k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int]:
    if k.dim() != 3 or k.shape != v.shape:
        raise ValueError(f"expected k, v [T, H, D] of one shape, got {tuple(k.shape)} {tuple(v.shape)}")
    return tuple(k.shape)
