"""The peers' KV formats as per-vector codecs, for serving them (sgl_kvq/formats/peers/): each quantizes one
(token, KV head) row x [..., D] into the tensors the engine stores for it and reads them back in fp32.

The arithmetic is sgl_kvq/formats/peers/reference.py's (the references, checked against the engines' sources), with the
constant tables on x's device; tests/unit/test_formats_peers.py compares the two bit for bit. Every one of these formats
is per token and head (blocks of 16 channels lie inside one head's row), so a row's codes never depend on other
tokens: a page is simply its tokens' rows.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from sgl_kvq.formats.peers import reference as peers
from sgl_kvq.quant import pack
from sgl_kvq.quant.bitpack import pack_bits, unpack_bits
from sgl_kvq.quant.rotation import random_orthogonal, rht_signs, sylvester_hadamard

Tail = tuple[tuple[int, ...], torch.dtype]  # one row's dims after [..., ] and its storage dtype


class Codec:
    """One row format. `tails(d)` names its tensors (the first is the codes) with their per-row dims and dtype."""

    def tails(self, d: int) -> dict[str, Tail]:
        raise NotImplementedError

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [..., D] -> the tensors of tails(D), in its order, [..., *dims]."""
        raise NotImplementedError

    def dequantize(self, *stored: torch.Tensor) -> torch.Tensor:
        """The stored tensors -> x_hat [..., D] fp32."""
        raise NotImplementedError

    def round_trip(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequantize(*self.quantize(x))


class Fp8E4M3(Codec):
    """SGLang's fp8_e4m3 at its default scale 1 (no calibrated KV scales): x cast to float8_e4m3fn."""

    def tails(self, d):
        return {"codes": ((d,), torch.uint8)}

    def quantize(self, x):
        return (x.float().to(torch.float8_e4m3fn).view(torch.uint8),)

    def dequantize(self, codes):
        return codes.view(torch.float8_e4m3fn).float()


class Fp4MxBlock16(Codec):
    """SGLang's fp4_mx_block16 (FP4MXBlock16KVQuantizeUtil): E2M1 codes, a power-of-two uint8 scale per 16."""

    def tails(self, d):
        return {"codes": ((d // 2,), torch.uint8), "scale": ((d // 16,), torch.uint8)}

    def quantize(self, x):
        lead, d = x.shape[:-1], x.shape[-1]
        codes, scale = peers.fp4_mx_block16_quantize(x.reshape(-1, 1, d))
        return codes.reshape(*lead, d // 2), scale.reshape(*lead, d // 16)

    def dequantize(self, codes, scale):
        lead, dh = codes.shape[:-1], codes.shape[-1]
        return peers.fp4_mx_block16_dequantize(codes.reshape(-1, 1, dh), scale.reshape(-1, dh // 8)).reshape(
            *lead, 2 * dh)


class NvFp4(Codec):
    """SGLang's nvfp4 KV: E2M1 codes, an FP8-E4M3 scale per 16, one global scale per layer and tensor. The global
    scale is 1.0, SGLang's value when the checkpoint has no calibrated KV scales: a constant, no bytes per token."""

    global_scale = 1.0

    def tails(self, d):
        return {"codes": ((d // 2,), torch.uint8), "scale": ((d // 16,), torch.uint8)}

    def quantize(self, x):
        codes, sf = peers.nvfp4_quantize(x, self.global_scale)
        return codes, sf.view(torch.uint8)

    def dequantize(self, codes, scale):
        return peers.nvfp4_dequantize(codes, scale.view(torch.float8_e4m3fn), self.global_scale)


@lru_cache(maxsize=16)
def _rht_tables(d: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return sylvester_hadamard(d).to(device), rht_signs(d).to(device)


class Int4PerTokenHead(Codec):
    """vLLM's int4_per_token_head (asymmetric, as shipped): the randomized Hadamard transform along D, then 4-bit
    min/max codes per (token, head) with the zero point in the 4 low mantissa bits of the fp32 scale. Read back
    in the original basis (the inverse transform over D), which attention with the unrotated q equals."""

    def tails(self, d):
        return {"codes": ((d // 2,), torch.uint8), "scale": ((), torch.float32)}

    def quantize(self, x):
        h, s = _rht_tables(x.shape[-1], x.device)
        y = (x.float() * s) @ h
        lo, hi = y.amin(-1, keepdim=True), y.amax(-1, keepdim=True)
        scale = torch.clamp((hi - lo) / 15.0, min=1e-6)
        zp = torch.clamp(peers._round_half_away(-lo / scale), 0.0, 15.0)
        q = torch.clamp(peers._round_half_away(y * (1.0 / scale) + zp), 0.0, 15.0)
        bits = scale.squeeze(-1).contiguous().view(torch.int32)
        stored_scale = ((bits & -16) | zp.squeeze(-1).to(torch.int32)).view(torch.float32)
        return pack.pack(q.to(torch.uint8).contiguous(), 4), stored_scale

    def dequantize(self, codes, scale):
        d = codes.shape[-1] * 2
        h, s = _rht_tables(d, codes.device)
        sbits = scale.contiguous().view(torch.int32)
        zp = (sbits & 0xF).float().unsqueeze(-1)
        step = (sbits & -16).view(torch.float32).unsqueeze(-1)
        y_hat = (pack.unpack(codes, 4).float() - zp) * step
        return ((y_hat @ h) * s) / d


@lru_cache(maxsize=16)
def _tq_tables(d: int, bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    cent, mids = peers.lloyd_max(d, bits)
    return random_orthogonal(d, 42).to(device), cent.to(device), mids.to(device)


class TurboQuantKeys(Codec):
    """vLLM TurboQuant's keys (PR #38479, "_nc" presets): the norm in fp16, the unit vector rotated by the seed-42
    random orthogonal matrix and coded per coordinate by the Lloyd-Max levels of N(0, 1/D), renormalized on read."""

    def __init__(self, bits: int):
        self.bits = bits

    def tails(self, d):
        return {"codes": ((d * self.bits // 8,), torch.uint8), "norm": ((), torch.float16)}

    def quantize(self, x):
        rot, _, mids = _tq_tables(x.shape[-1], self.bits, x.device)
        norm = x.float().norm(dim=-1, keepdim=True)
        y = (x.float() / norm.clamp(min=1e-12)) @ rot.T
        idx = torch.bucketize(y, mids, right=True).clamp(max=2 ** self.bits - 1).to(torch.uint8)
        return pack_bits(idx, self.bits), norm.squeeze(-1).to(torch.float16)

    def dequantize(self, codes, norm):
        d = codes.shape[-1] * 8 // self.bits
        rot, cent, _ = _tq_tables(d, self.bits, codes.device)
        c = cent[unpack_bits(codes, self.bits, d).long()]
        c = c / c.norm(dim=-1, keepdim=True).clamp(min=1e-12)
        return (c @ rot) * norm.float().unsqueeze(-1)


class TurboQuantValues(Codec):
    """vLLM TurboQuant's values: min/max codes over D per (token, head), fp16 scale and zero (= min)."""

    def __init__(self, bits: int):
        self.bits = bits

    def tails(self, d):
        return {"codes": ((d * self.bits // 8,), torch.uint8), "scale": ((), torch.float16),
                "zero": ((), torch.float16)}

    def quantize(self, x):
        packed, s16, z16, _ = peers._tq_uniform(x, self.bits)
        return packed, s16, z16

    def dequantize(self, codes, scale, zero):
        d = codes.shape[-1] * 8 // self.bits
        return unpack_bits(codes, self.bits, d).float() * scale.float().unsqueeze(-1) + zero.float().unsqueeze(-1)
