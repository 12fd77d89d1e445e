"""SpeCache's decode read modelled offline for `sgl-kvq eval attention` (its attention error on captured Q/K/V).

The device holds KIVI's low-bit copy with its fp16 window (quant.kivi at 1 or 2 bits); each decode step reads, per
KV head, the top-k base positions in 16 bits from the host tier instead. The model ranks them as the served decode
does (sgl_kvq/specache/attention.py top_positions): by the speculative row's attention over the low-bit copy,
summed over each KV head's query heads, plus with `follow` the previous real row's mass one position earlier. The
speculative row is modelled by the real query of the step (a next-token guess that was right, as specache2's was at
every needle step: sgl_kvq/config.py), attending over the low-bit copy alone (served, its keys also hold the
previous step's 16-bit rows). A wrong guess ranks by another token's query: this is the read when the lane guessed
right. Every query of the sequence is modelled as a decode step over the cache as it stands at length T, as the
other methods are (bench/eval/attention.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl_kvq.quant.compressed import fp16
from bench.quant.kivi import kivi
from bench.quant.kivi_bits import kivi_bits
from bench.eval.masks import visible


class SpeCacheRead(NamedTuple):
    """The low-bit copy (CompressedKV's fields: what the device stores, for the bits column) and the read."""
    k_hat: torch.Tensor
    v_hat: torch.Tensor
    stored: dict
    kept: torch.Tensor
    k16: torch.Tensor  # [T, H, D] the host tier's 16-bit rows
    v16: torch.Tensor
    base: int  # positions below it are packed base (above: the fp16 window)
    top_k: int
    follow: bool

    def attend(self, q: torch.Tensor, sm_scale: float, chunk: int = 256, window: int | None = None) -> torch.Tensor:
        """q [T, Hq, D] -> O [T, Hq, D] fp32: query i over keys 0..i (a sliding layer's i - window + 1..i), its
        top-k base positions per KV head among those read in 16 bits, the rest from the low-bit copy."""
        T, hq, _ = q.shape
        grp = hq // self.k_hat.shape[1]
        v16, v_hat = self.v16.repeat_interleave(grp, 1), self.v_hat.repeat_interleave(grp, 1)
        k16 = self.k16.repeat_interleave(grp, 1)
        out = torch.empty(T, hq, self.v_hat.shape[-1])
        prev = None
        for lo in range(0, T, chunk):
            hi = min(T, lo + chunk)
            s_low, chosen, prev = self._chunk(q, sm_scale, lo, hi, prev, window)
            pick = chosen.repeat_interleave(grp, 0)  # [Hq, R, T]
            s16 = torch.einsum("rhd,thd->hrt", q[lo:hi].float(), k16) * sm_scale
            p = torch.softmax(torch.where(pick, s16, s_low), dim=-1)  # s_low is -inf past each row
            out[lo:hi] = torch.einsum("hrt,thd->rhd", p * pick, v16) + torch.einsum("hrt,thd->rhd", p * ~pick, v_hat)
        return out

    def picks(self, q: torch.Tensor, sm_scale: float, window: int | None = None) -> torch.Tensor:
        """The positions each query reads in 16 bits: [T, H, T] bool (query, KV head, position)."""
        return self._chunk(q, sm_scale, 0, q.shape[0], None, window)[1].permute(1, 0, 2)

    def _chunk(self, q: torch.Tensor, sm_scale: float, lo: int, hi: int, prev: torch.Tensor | None,
               window: int | None = None):
        """Queries lo..hi-1: their causal scores over the low-bit copy [Hq, R, T], the positions they read in 16
        bits [H, R, T], and the last one's mass per KV head [H, T] (the next chunk's follow)."""
        T, hq, _ = q.shape
        H = self.k_hat.shape[1]
        grp = hq // H
        rows = torch.arange(lo, hi)
        causal = visible(rows, T, window)  # [R, T]
        s_low = torch.einsum("rhd,thd->hrt", q[lo:hi].float(), self.k_hat.repeat_interleave(grp, 1)) * sm_scale
        s_low = s_low.masked_fill(~causal, float("-inf"))
        mass = torch.softmax(s_low, dim=-1).view(H, grp, hi - lo, T).sum(1)  # the speculative row's ranking
        rank = mass.clone()
        if self.follow:  # the real row one step earlier: its mass at p - 1 ranks p
            first = torch.zeros_like(mass[:, :1]) if prev is None else prev[:, None]
            earlier = torch.cat([first, mass[:, :-1]], dim=1)
            rank[:, :, 1:] += earlier[:, :, :-1]
        return s_low, self._top(rank, causal), mass[:, -1]

    def _top(self, rank: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        """The top_k base positions each row sees (`causal` [R, T], t < base), per KV head -> a mask [H, R, T]."""
        H, R, T = rank.shape
        n = min(self.top_k, self.base)
        chosen = torch.zeros(H, R, T, dtype=torch.bool)
        if n == 0:
            return chosen
        seen = causal & (torch.arange(T)[None, :] < self.base)  # [R, T]
        ranked = rank.masked_fill(~seen, float("-inf"))
        idx = ranked[:, :, :self.base].topk(n, dim=-1).indices  # [H, R, n]
        valid = torch.gather(seen[None].expand(H, R, T)[:, :, :self.base], 2, idx)  # rows that see fewer than n
        chosen.scatter_(2, idx, valid)
        return chosen


def specache(k: torch.Tensor, v: torch.Tensor, *, bits: int, top_k: int, follow: bool = True, group_size: int = 64,
             value_group: int = 64, residual: int = 64, values_basis: torch.Tensor | None = None,
             value_bits: int | None = None) -> SpeCacheRead:
    """specache<bits> at top_k: KIVI's low-bit copy (1-bit with SpeCache's zero/scale) and the 16-bit rows.
    values_basis R: the values stored as v @ R, both copies (KVQ_ROTATE=values); the read is linear in them, so
    their reconstructions rotated back by R^T give its output in the model's basis. value_bits: the copy's values
    at their own width (a K/V split of the device copy)."""
    v_in = v.float() if values_basis is None else v.float() @ values_basis
    page = dict(group_size=group_size, value_group=value_group, residual=residual)
    c = (kivi(k, v_in, bits=bits, **page) if value_bits in (None, bits)
         else kivi_bits(k, v_in, bits=bits, value_bits=value_bits, **page))
    base = int((~c.kept[:, 0]).sum()) if c.kept is not None else k.shape[0]
    v_hat, v16 = c.v_hat, fp16(v_in)
    if values_basis is not None:
        v_hat, v16 = v_hat @ values_basis.T, v16.float() @ values_basis.T
    return SpeCacheRead(c.k_hat, v_hat, c.stored, c.kept, fp16(k), v16, base, top_k, follow)
