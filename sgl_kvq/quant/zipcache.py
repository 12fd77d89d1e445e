"""ZipCache: mixed precision by normalized attention saliency, on pages.

- Saliency (ZipCache section 4): attention from probe queries only, 5% most recent + 5% random positions (seeded).
  A token's normalized score = attention it receives from the probes, summed over the probes and over the query
  heads of its KV head, divided by the number of (probe, query head) pairs that can see it (causal: probe i >= j).
  Dividing by that count removes the causal bias of plain accumulated attention towards early tokens.
- The top `salient_ratio` (default 40%) of the quantized tokens of each KV head are salient: `hi_bits` (4), the rest
  `lo_bits` (2). A 1-bit-per-(token, head) map says which plane a token is in (stored, counted).
- Keys channel-wise: per page (G tokens), per channel, one fp16 (scale, zero) per precision class over that class's
  tokens in the page (ZipCache scales per channel; the page keeps them mappable onto the pool).
- Values channel-separable token-wise: c_i = sqrt(max_t |V[t, i]|) per page and channel (fp16), quantize V / c per
  token in groups of VG channels at the token's class bits, multiply back by c.
The fp16 window and open page are KIVI's, so zipcache vs kivi compares only the mixed precision and the formats.
"""

from __future__ import annotations

import math

import torch

from sgl_kvq.quant import pack, uniform
from sgl_kvq.quant.compressed import CompressedKV, check_kv
from sgl_kvq.quant.kivi import quantized_len


def probe_positions(T: int, recent: float = 0.05, random: float = 0.05, seed: int = 0) -> torch.Tensor:
    n_recent = max(1, math.ceil(recent * T))
    n_random = min(T - n_recent, math.ceil(random * T))
    older = torch.randperm(T - n_recent, generator=torch.Generator().manual_seed(seed))[:n_random]
    return torch.cat([older.sort().values, torch.arange(T - n_recent, T)])


def normalized_attention(q: torch.Tensor, k: torch.Tensor, probes: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """q [T, Hq, D], k [T, H, D], probes [P] -> [T, H] normalized attention score of every key."""
    T, H, D = k.shape
    group = q.shape[1] // H
    qp = q[probes].float().reshape(len(probes), H, group, D)
    s = torch.einsum("phgd,thd->hgpt", qp, k.float()) * sm_scale
    visible = torch.arange(T)[None, :] <= probes[:, None]  # [P, T]
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    received = p.sum(dim=(1, 2)).T  # [T, H]
    seen_by = visible.sum(0).clamp(min=1) * group  # [T]
    return received / seen_by[:, None]


def salient_mask(score: torch.Tensor, ratio: float) -> torch.Tensor:
    """score [n, H] -> [n, H] bool, the top round(ratio * n) tokens of each head."""
    n = score.shape[0]
    m = torch.zeros_like(score, dtype=torch.bool)
    top = round(ratio * n)
    return m.scatter_(0, score.topk(top, dim=0).indices, True) if top else m


def _bitmap(mask: torch.Tensor) -> torch.Tensor:
    flat = mask.reshape(-1).to(torch.uint8)
    pad = (-flat.numel()) % 8
    return pack.pack(torch.cat([flat, flat.new_zeros(pad)]), 1)


def _keys(x, sal, hi_bits, lo_bits, G):
    """x [n, H, D], sal [n, H] -> (x_hat, stored): per page, class and channel scale/zero."""
    n, H, D = x.shape
    xp, mp = x.reshape(n // G, G, H, D), sal.reshape(n // G, G, H, 1)
    scale, zero, codes = [], [], torch.zeros(xp.shape, dtype=torch.uint8)
    for cls, bits in ((mp, hi_bits), (~mp, lo_bits)):
        lo = torch.where(cls, xp, torch.inf).amin(1, keepdim=True)
        hi = torch.where(cls, xp, -torch.inf).amax(1, keepdim=True)
        empty = ~cls.any(1, keepdim=True)
        lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
        s, z = uniform.scale_zero(lo, hi, bits)
        codes = torch.where(cls, uniform.encode(xp, s, z, bits), codes)
        scale.append(s)
        zero.append(z)
    stored = {"k.codes_hi": pack.pack(codes[mp.squeeze(-1)], hi_bits),
              "k.codes_lo": pack.pack(codes[~mp.squeeze(-1)], lo_bits),
              "k.scale": torch.cat(scale, 1), "k.zero": torch.cat(zero, 1),  # [pages, 2, H, D]
              "k.salient_map": _bitmap(sal)}
    back = torch.zeros(xp.shape, dtype=torch.uint8)
    back[mp.squeeze(-1)] = pack.unpack(stored["k.codes_hi"], hi_bits)
    back[~mp.squeeze(-1)] = pack.unpack(stored["k.codes_lo"], lo_bits)
    s = torch.where(mp, stored["k.scale"][:, :1], stored["k.scale"][:, 1:])
    z = torch.where(mp, stored["k.zero"][:, :1], stored["k.zero"][:, 1:])
    return uniform.dequantize(back, s, z).reshape(n, H, D), stored


def _values(x, sal, hi_bits, lo_bits, G, value_group):
    n, H, D = x.shape
    vg = min(value_group, D)
    xp = x.reshape(n // G, G, H, D)
    c = xp.abs().amax(1, keepdim=True).sqrt().clamp(min=1e-3).to(torch.float16)  # [pages, 1, H, D]
    xn = (xp / c.float()).reshape(n, H, D)
    x_hat = torch.zeros(n, H, D)
    stored = {"v.chan_scale": c.squeeze(1)}
    for tag, cls, bits in (("hi", sal, hi_bits), ("lo", ~sal, lo_bits)):
        q = uniform.quantize_channel_groups(xn[cls], bits, vg)
        stored.update({f"v.codes_{tag}": pack.pack(q.codes, bits), f"v.scale_{tag}": q.scale,
                       f"v.zero_{tag}": q.zero})
        x_hat[cls] = uniform.dequantize_channel_groups(pack.unpack(stored[f"v.codes_{tag}"], bits), q.scale, q.zero)
    return (x_hat.reshape(n // G, G, H, D) * c.float()).reshape(n, H, D), stored


def zipcache(k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, sm_scale: float | None = None,
             hi_bits: int = 4, lo_bits: int = 2, salient_ratio: float = 0.4, group_size: int = 64,
             value_group: int = 64, residual: int = 64, probe_recent: float = 0.05, probe_random: float = 0.05,
             seed: int = 0) -> CompressedKV:
    """q [T, Hq, D]: the real queries (post-RoPE) the probes are drawn from."""
    T, H, D = check_kv(k, v)
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    n_q = quantized_len(T, group_size, residual)
    score = normalized_attention(q, k, probe_positions(T, probe_recent, probe_random, seed), sm_scale)
    sal = salient_mask(score[:n_q], salient_ratio)
    k_hat, stored = _keys(k[:n_q].float(), sal, hi_bits, lo_bits, group_size)
    v_hat, v_stored = _values(v[:n_q].float(), sal, hi_bits, lo_bits, group_size, value_group)
    stored.update(v_stored)
    stored["k.fp16"] = k[n_q:].to(torch.float16)
    stored["v.fp16"] = v[n_q:].to(torch.float16)
    kept = torch.cat([sal, torch.ones(T - n_q, H, dtype=torch.bool)])
    return CompressedKV(torch.cat([k_hat, stored["k.fp16"].float()]), torch.cat([v_hat, stored["v.fp16"].float()]),
                        stored, kept)
