"""Sequence-level KIVI at any bit width 1..8, its codes in one bit stream per row.

bench.quant.kivi.kivi takes a bit width, but its pages go through sgl_kvq.quant.pack, which holds 1/2/3/4/8-bit
codes only (3 bits as a 2-bit and a 1-bit plane: the served kivi3's layout, the same values and bytes as here). This
is the same quantizer (sgl_kvq.quant.uniform: keys per channel over each page of G tokens, values per
token in groups of VG channels, fp16 scale and zero each, SpeCache's zero/scale at 1 bit) and the same split of the
sequence (complete pages outside the fp16 window are quantized; the R // G window pages and the open page stay fp16,
see kivi.quantized_len), with codes packed by sgl_kvq.quant.bitpack, a bit stream that equals pack.py's layout at
1/2/4/8 bits. At b bits a quantized element costs b + 32 / G (keys) and b + 32 / VG (values) bits; at G = VG = 64,
3 bits: 3.5 bits per element before the fp16 window is amortized.
"""

from __future__ import annotations

import torch

from sgl_kvq.quant import uniform
from sgl_kvq.quant.bitpack import pack_bits, unpack_bits
from sgl_kvq.quant.compressed import CompressedKV, check_kv
from bench.quant.kivi import quantized_len


def kivi_bits(k: torch.Tensor, v: torch.Tensor, *, bits: int = 3, group_size: int = 64, value_group: int = 64,
              residual: int = 64, specache_one_bit: bool = True, value_bits: int | None = None) -> CompressedKV:
    """KIVI at `bits` in 1..8 on k, v [T, H, D]; equals kivi.kivi (values and bytes) at 1, 2, 4 and 8 bits.
    value_bits: the values' width where it differs from the keys' (a kivimix recipe's layer)."""
    T, H, D = check_kv(k, v)
    v_bits = bits if value_bits is None else value_bits
    n_q = quantized_len(T, group_size, residual)
    vg = min(value_group, D)
    kq = uniform.quantize(k[:n_q].reshape(n_q // group_size, group_size, H, D), bits, dims=1,
                          specache_one_bit=specache_one_bit)  # scale/zero [N, 1, H, D]
    vq = uniform.quantize_channel_groups(v[:n_q], v_bits, vg, specache_one_bit=specache_one_bit)
    stored = {"k.codes": pack_bits(kq.codes, bits), "k.scale": kq.scale.squeeze(1), "k.zero": kq.zero.squeeze(1),
              "v.codes": pack_bits(vq.codes, v_bits), "v.scale": vq.scale, "v.zero": vq.zero,
              "k.fp16": k[n_q:].to(torch.float16), "v.fp16": v[n_q:].to(torch.float16)}
    k_q = uniform.dequantize(unpack_bits(stored["k.codes"], bits, D), stored["k.scale"].unsqueeze(1),
                             stored["k.zero"].unsqueeze(1)).reshape(n_q, H, D)
    v_q = uniform.dequantize_channel_groups(unpack_bits(stored["v.codes"], v_bits, D), stored["v.scale"],
                                            stored["v.zero"])
    kept = torch.zeros(T, H, dtype=torch.bool)
    kept[n_q:] = True
    return CompressedKV(torch.cat([k_q, stored["k.fp16"].float()]), torch.cat([v_q, stored["v.fp16"].float()]),
                        stored, kept)
