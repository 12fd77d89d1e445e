"""FlexGen-style baseline: keys AND values quantized per token, in groups of VG channels.

Everything else (bits, the fp16 window and open page, value format) is KIVI's, so comparing this with kivi() isolates
KIVI's one observation: key outliers sit in fixed channels, so a per-channel range over G tokens fits keys better
than a per-token range over channels. Costs match at G == VG (an fp16 scale and zero per 64 elements either way).
"""

from __future__ import annotations

import torch

from sgl_kvq.quant import pack, uniform
from sgl_kvq.quant.compressed import CompressedKV, check_kv
from bench.quant.kivi import quantized_len


def quantize_per_token(x: torch.Tensor, bits: int, value_group: int, *, specache_one_bit: bool = True):
    """x [n, H, D] -> (x_hat, codes packed, scale, zero), one fp16 scale/zero per token-head per VG channels."""
    vg = min(value_group, x.shape[-1])
    q = uniform.quantize_channel_groups(x, bits, vg, specache_one_bit=specache_one_bit)
    codes = pack.pack(q.codes, bits)
    x_hat = uniform.dequantize_channel_groups(pack.unpack(codes, bits), q.scale, q.zero)
    return x_hat, codes, q.scale, q.zero


def per_token(k: torch.Tensor, v: torch.Tensor, *, bits: int = 2, group_size: int = 64, value_group: int = 64,
              residual: int = 64, specache_one_bit: bool = True) -> CompressedKV:
    T, H, D = check_kv(k, v)
    n_q = quantized_len(T, group_size, residual)
    stored, parts = {}, {}
    for name, x in (("k", k), ("v", v)):
        x_hat, codes, scale, zero = quantize_per_token(x[:n_q], bits, value_group, specache_one_bit=specache_one_bit)
        stored.update({f"{name}.codes": codes, f"{name}.scale": scale, f"{name}.zero": zero,
                       f"{name}.fp16": x[n_q:].to(torch.float16)})
        parts[name] = torch.cat([x_hat, stored[f"{name}.fp16"].float()])
    kept = torch.zeros(T, H, dtype=torch.bool)
    kept[n_q:] = True
    return CompressedKV(parts["k"], parts["v"], stored, kept)
