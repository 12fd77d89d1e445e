"""Honest byte accounting: bits per element a format actually stores, counted from the tensors it returned.

Everything in `CompressedKV.stored` counts at its real element size: packed uint8 codes, fp16 scales and zeros,
fp16 tokens (window, log-selected, salient planes), fp16 low-rank factors, and sparse outliers as one fp16 value plus
one int32 flat index each. Per-request bookkeeping that is O(1) (lengths, window start) is not counted.
"""

from __future__ import annotations

from typing import NamedTuple

from sgl_kvq.quant.compressed import CompressedKV


class Bits(NamedTuple):
    keys: float  # bits per key element (T * H * D elements)
    values: float
    total: float  # over keys and values together


def stored_bytes(c: CompressedKV, prefix: str = "") -> int:
    return sum(t.numel() * t.element_size() for name, t in c.stored.items() if name.startswith(prefix))


def breakdown(c: CompressedKV) -> dict[str, int]:
    """Bytes per stored tensor, for reports."""
    return {name: t.numel() * t.element_size() for name, t in c.stored.items()}


def bits_per_element(c: CompressedKV) -> Bits:
    n = c.k_hat.numel()
    if n == 0:
        return Bits(0.0, 0.0, 0.0)
    kb, vb = 8 * stored_bytes(c, "k."), 8 * stored_bytes(c, "v.")
    unknown = set(c.stored) - {x for x in c.stored if x.startswith(("k.", "v."))}
    if unknown:
        raise ValueError(f"stored tensors must be named k.* or v.*: {sorted(unknown)}")
    return Bits(kb / n, vb / n, (kb + vb) / (2 * n))


def kivi_page_bits(bits: int, group_size: int, value_group: int) -> tuple[float, float]:
    """Pool-level cost of one complete KIVI page, per element: an fp16 scale and zero (32 bits) per key channel per
    G tokens and per value token per VG channels, on top of the b-bit codes."""
    return bits + 32 / group_size, bits + 32 / value_group


def kivi_expected_bits(T: int, bits: int, group_size: int, value_group: int, quantized_tokens: int) -> Bits:
    """The same cost at sequence level: complete pages at kivi_page_bits, every other token at fp16 (16 bits)."""
    kp, vp = kivi_page_bits(bits, group_size, value_group)
    fp = T - quantized_tokens
    k = (quantized_tokens * kp + fp * 16) / T
    v = (quantized_tokens * vp + fp * 16) / T
    return Bits(k, v, (k + v) / 2)
