"""A forward batch's steps for both kvq backends, from the host-side builders (sgl_kvq/metadata/host.py): per
forward batch, where its tokens go (BatchWrite) and what each request attends to (PagedPlan), built once and
reused by every layer (FlashInfer's plan/run split). kvq_triton's decode uses sgl_kvq/metadata/device.py instead.

An extend is one step (prefill mode "full") or, in mode "paged", one step per page the new tokens touch: step j
holds every request's new tokens that fall in its j-th touched page, attends to everything before them as the
plan computed after steps < j claimed their frames, then writes. Every layer runs the steps in order, so a step's
attention sees the earlier steps' pages exactly as a later decode will (quantized beyond the fp16 window). A
backend that attends to the whole paged extend after its write (kvq_torch) takes it as one step instead, with a
PagedReread: the same keys, one write and one read of each page per layer. Why: 4 cold 1,024-token prompts on
SmolLM2 took 4.1 s in page steps against 2.9 s "full" (kivi4, 2-core CPU); py-spy put most of the difference in
the per-step writes and reads.
"""

from __future__ import annotations

import torch

from sgl_kvq.kv_store import QuantizedKVStore
from sgl_kvq.metadata.host import begin_batch, plan_contexts
from sgl_kvq.plan import ForwardPlan, PagedPlan, PagedReread, Step


def _tokens(reqs, starts, ends, dev):
    """Per written token: its request slot, position, and its request's length after the step."""
    req_slots = torch.tensor([r for r, a, b in zip(reqs, starts, ends) for _ in range(b - a)], dtype=torch.int64,
                             device=dev)
    positions = torch.cat([torch.arange(a, b, device=dev) for a, b in zip(starts, ends)]) if req_slots.numel() \
        else torch.empty(0, dtype=torch.int64, device=dev)
    after = torch.tensor([b for a, b in zip(starts, ends) for _ in range(b - a)], dtype=torch.int64, device=dev)
    return req_slots, positions, after


def page_tables(req_to_token: torch.Tensor, reqs: list[int], lens: list[int], G: int) -> list[torch.Tensor]:
    """Pool page ids of each request's logical pages 0, 1, ... covering its first lens[b] positions."""
    return [req_to_token[r, : -(-n // G) * G: G].long() // G for r, n in zip(reqs, lens)]


def read_plan(store: QuantizedKVStore, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
              context_lens: torch.Tensor) -> PagedPlan:
    """The plan of contexts as they are (no token written, no frame claimed): a read-only lane."""
    reqs, lens = req_pool_indices.tolist(), context_lens.tolist()
    return plan_contexts(store, page_tables(req_to_token, reqs, lens, store.G), reqs, lens)


def build_forward_plan(store: QuantizedKVStore, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                       seq_lens: torch.Tensor, out_cache_loc: torch.Tensor, *, is_decode: bool,
                       extend_prefix_lens: list[int] | None = None,
                       extend_seq_lens: list[int] | None = None, page_steps: bool = True) -> ForwardPlan:
    """seq_lens: [B] each request's length after the batch; out_cache_loc: the slots of its new tokens. An
    extend also needs extend_prefix_lens/extend_seq_lens (host lists): the cached prefix and the new tokens.
    page_steps=False: a paged extend as one step with a PagedReread."""
    G = store.G
    reqs = req_pool_indices.tolist()
    lens = seq_lens.tolist()
    dev = store.device
    tables = page_tables(req_to_token, reqs, lens, G)
    if is_decode:
        write = begin_batch(store, out_cache_loc, *_tokens(reqs, [n - 1 for n in lens], lens, dev))
        return ForwardPlan(is_decode=True, steps=[Step(plan=plan_contexts(store, tables, reqs, lens), write=write)])
    prefix, new = list(extend_prefix_lens), list(extend_seq_lens)
    if any(p + n != s for p, n, s in zip(prefix, new, lens)):
        raise AssertionError("sgl_kvq: extend prefix + new lengths != seq_lens")
    if store.cfg.prefill == "paged" and not page_steps:
        return ForwardPlan(is_decode=False, steps=[_paged_in_one_step(store, tables, reqs, prefix, lens,
                                                                      out_cache_loc)])
    row0 = [0]
    for n in new:
        row0.append(row0[-1] + n)
    if store.cfg.prefill == "full":
        bounds = [[(p, s)] for p, s in zip(prefix, lens)]
    else:  # "paged": cut each request's new tokens at page boundaries
        bounds = [[(a, min(s, (a // G + 1) * G)) for a in [p] + list(range((p // G + 1) * G, s, G)) if a < s]
                  for p, s in zip(prefix, lens)]
    one_step = all(len(b) == 1 for b in bounds)  # then the step's rows are all rows, in order
    steps = []
    for j in range(max((len(b) for b in bounds), default=0)):
        starts = [b[j][0] if j < len(b) else s for b, s in zip(bounds, lens)]
        ends = [b[j][1] if j < len(b) else s for b, s in zip(bounds, lens)]
        rows = torch.cat([torch.arange(row0[i] + a - p, row0[i] + e - p, device=dev)
                          for i, (a, e, p) in enumerate(zip(starts, ends, prefix))])
        # Read the context as it is before this step, then let the step's tokens claim their frames. "paged"
        # steps see the fp16 window of their own page (as decode will); "full" sees the prefix's own window.
        plan = plan_contexts(store, tables, reqs, starts, query_pos=starts if store.cfg.prefill == "paged" else None)
        write = begin_batch(store, out_cache_loc[rows], *_tokens(reqs, starts, ends, dev))
        counts = [e - a for a, e in zip(starts, ends)]
        qo = torch.tensor([0] + counts, dtype=torch.int32, device=dev).cumsum(0).to(torch.int32)
        steps.append(Step(plan=plan, write=write, rows=None if one_step else rows, qo_indptr=qo,
                          max_qo_len=max(counts)))
    return ForwardPlan(is_decode=False, steps=steps)


def _paged_in_one_step(store: QuantizedKVStore, tables: list[torch.Tensor], reqs: list[int], prefix: list[int],
                       lens: list[int], out_cache_loc: torch.Tensor) -> Step:
    """A paged extend as one step: the prefix as its first page step reads it (its fp16 window that of a query at
    the prefix's end), every new token written at once, and the pages a new token reads quantized (PagedReread)."""
    G, ring, dev = store.G, store.ring, store.device
    plan = plan_contexts(store, tables, reqs, prefix, query_pos=prefix)
    write = begin_batch(store, out_cache_loc, *_tokens(reqs, prefix, lens, dev))
    first = (plan.kv_indptr[1:] - plan.kv_indptr[:-1]).tolist()  # pages before a frame: the plan's base pages
    # the last new token (position s - 1) reads pages up to its page - ring quantized; earlier tokens fewer
    reread = [t[f:max(f, (s - 1) // G - ring + 1)] if s > p else t[:0]
              for t, f, p, s in zip(tables, first, prefix, lens)]
    counts = [s - p for p, s in zip(prefix, lens)]
    qo = torch.tensor([0] + counts, dtype=torch.int32, device=dev).cumsum(0).to(torch.int32)
    return Step(plan=plan, write=write, qo_indptr=qo, max_qo_len=max(counts),
                reread=PagedReread(first_page=first, pages=reread, ring=ring))
