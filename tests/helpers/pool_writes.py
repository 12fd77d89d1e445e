"""A request's K/V written into a KVQTokenToKVPool through the real store path (begin_batch + write_layer), and
its context read back through a plan (gather_context, and attention through the reference): the pool-level tests of
PD transfer and the HiCache host pool."""

from __future__ import annotations

import functools

import torch

from sgl_kvq.attention_ref import gather_context, ref_decode
from sgl_kvq.metadata.host import begin_batch, plan_contexts

L, H, D, HQ, SM = 3, 2, 64, 4, 0.125  # 3 layers: LogQuant's 9 buffers give an odd transfer entry count


@functools.lru_cache(maxsize=None)
def _table(layer: int, seed: int, n: int = 1024):
    g = torch.Generator().manual_seed(seed * 1_000_003 + layer)
    return (torch.randn(n, H, D, generator=g) * 2 + torch.arange(D) * 0.05, torch.randn(n, H, D, generator=g),
            torch.randn(n, HQ, D, generator=g))


def kv_of(pos: torch.Tensor, layer: int, seed: int):
    """K, V [T, H, D] and Q [T, HQ, D] for positions pos: a function of (position, layer, seed) only."""
    return tuple(t[pos] for t in _table(layer, seed))


def write(pool, r: int, pages: torch.Tensor, start: int, end: int, seed: int) -> None:
    G = pool.shape.G
    pos = torch.arange(start, end)
    locs = pages[pos // G] * G + pos % G
    bw = begin_batch(pool.store, locs, torch.full_like(pos, r), pos, torch.full_like(pos, end))
    for layer in range(L):
        k, v, q = kv_of(pos, layer, seed)
        pool.store.write_layer(layer, bw, k, v, q=q if pool.cfg.format.codec.needs_queries else None, sm_scale=SM)


def read(pool, r: int, pages: torch.Tensor, n: int, q: torch.Tensor):
    plan = plan_contexts(pool.store, [pages], [r], [n])
    views = [pool.store.layer_view(layer) for layer in range(L)]
    return [gather_context(kv, plan, 0) for kv in views], [ref_decode(q, kv, plan, SM) for kv in views], plan
