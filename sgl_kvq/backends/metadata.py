"""One metadata builder for both kvq backends: per forward batch, where its tokens go (BatchWrite) and what each
request attends to (PagedPlan), built once and reused by every layer (FlashInfer's plan/run split)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kvq.attention_ref import PagedPlan
from sgl_kvq.kv_store import BatchWrite, QuantizedKVStore


@dataclass
class ForwardPlan:
    is_decode: bool
    write: BatchWrite
    plan: PagedPlan  # decode: the whole context after this token; extend: the cached prefix only
    qo_indptr: torch.Tensor | None  # extend: request b's new tokens are rows qo_indptr[b]:qo_indptr[b+1]


def build(store: QuantizedKVStore, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
          seq_lens: torch.Tensor, out_cache_loc: torch.Tensor, is_decode: bool,
          extend_prefix_lens: list[int] | None = None, extend_seq_lens: list[int] | None = None) -> ForwardPlan:
    G = store.G
    reqs = req_pool_indices.tolist()
    lens = seq_lens.tolist()
    dev = store.device
    if is_decode:
        prefix = [n - 1 for n in lens]
        new = [1] * len(lens)
    else:
        prefix, new = list(extend_prefix_lens), list(extend_seq_lens)
        if any(p + n != s for p, n, s in zip(prefix, new, lens)):
            raise AssertionError("sgl_kvq: extend prefix + new lengths != seq_lens")
    page_tables = [req_to_token[r, : -(-n // G) * G : G].long() // G for r, n in zip(reqs, lens)]
    req_slots = torch.tensor([r for r, n in zip(reqs, new) for _ in range(n)], dtype=torch.int64, device=dev)
    positions = torch.cat([torch.arange(p, p + n, device=dev) for p, n in zip(prefix, new)]) if new else \
        torch.empty(0, dtype=torch.int64, device=dev)
    after = torch.tensor([s for s, n in zip(lens, new) for _ in range(n)], dtype=torch.int64, device=dev)
    if is_decode:
        write = store.begin_batch(out_cache_loc, req_slots, positions, after)
        plan = store.plan(page_tables, reqs, lens)
        return ForwardPlan(True, write, plan, None)
    # Extend reads the prefix as it was before this batch: plan first, then let the batch claim frames.
    plan = store.plan(page_tables, reqs, prefix)
    write = store.begin_batch(out_cache_loc, req_slots, positions, after)
    qo = torch.tensor([0] + new, dtype=torch.int32, device=dev).cumsum(0).to(torch.int32)
    return ForwardPlan(False, write, plan, qo)
