"""Decode metadata built on the device with fixed shapes and no host sync: kvq_triton's decode path, eager and
under CUDA graphs alike.

For a decode batch (one new token per request) `build_decode` does what host.begin_batch followed by
host.plan_contexts do on the host (the reference, sgl_kvq/metadata/host.py; tests/unit/test_decode_metadata.py compares
the two on random pool states), as static-shape torch ops over capacity-sized buffers, so the same code runs
eagerly and inside a captured graph (SGLang's `init_forward_metadata_in_graph` contract: no .item() / .tolist() /
dynamic shapes):

    begin  page_gen[page] += 1 where the token opens a page (offset 0): frames of a reused page stop matching it;
           the token's frame (its slot's, sgl_kvq/frames.py) is tagged with (page, page_gen[page])
    write  frame_ids [B], frame_offs [B]: where each token's fp16 row goes; done_pages [B]: the pool page the token
           completes (offset G - 1), 0 when none (page 0 is SGLang's dummy page: the quantize kernel skips it)
    plan   the PagedPlan of every request's context after its token: the longest suffix of its last `ring` logical
           pages whose frames still hold them comes from the overlay, the pages before it from the packed base

Padded rows of a CUDA-graph batch (SGLang pads with request slot 0, out_cache_loc 0 and seq_len 1) write request
slot 0's frames and page 0, both reserved and never read by a real request (pooled frames: slot 0's frames are the
dummy frame 0, and a padded row writes only its first row, which lies in page 0: sgl_kvq/frames.py).
"""

from __future__ import annotations

import torch

from sgl_kvq.plan import DecodeWrite, PagedPlan


class DecodeBuffers:
    """Capacity-sized outputs of build_decode, allocated once: a CUDA graph captures their addresses.

    max_bs requests, each with a context of at most max_pages pages; indices buffers carry one trailing "trash"
    entry that masked-out scatters write to (a static-shape substitute for boolean indexing)."""

    def __init__(self, max_bs: int, max_pages: int, ring: int, device: torch.device):
        i32 = dict(dtype=torch.int32, device=device)
        self.max_bs, self.max_pages, self.ring = max_bs, max_pages, ring
        self.kv_indptr = torch.zeros(max_bs + 1, **i32)
        self.kv_indices = torch.zeros(max_bs * max_pages + 1, **i32)
        self.kv_last_page_len = torch.zeros(max_bs, **i32)
        self.ov_indptr = torch.zeros(max_bs + 1, **i32)
        self.ov_indices = torch.zeros(max_bs * ring + 1, **i32)
        self.ov_last_page_len = torch.zeros(max_bs, **i32)
        self.frame_ids = torch.zeros(max_bs, **i32)
        self.frame_offs = torch.zeros(max_bs, **i32)
        self.done_pages = torch.zeros(max_bs, **i32)
        self.done_lpages = torch.zeros(max_bs, **i32)
        self.page_cols = torch.arange(max_pages, device=device)  # logical page numbers 0 .. max_pages - 1
        self.ring_cols = torch.arange(ring, device=device)

    def views(self, bs: int) -> tuple[DecodeWrite, PagedPlan]:
        return (DecodeWrite(self.frame_ids[:bs], self.frame_offs[:bs], self.done_pages[:bs],
                            self.done_lpages[:bs]),
                PagedPlan(self.kv_indptr[:bs + 1], self.kv_indices, self.kv_last_page_len[:bs],
                          self.ov_indptr[:bs + 1], self.ov_indices, self.ov_last_page_len[:bs]))


def build_decode(store, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                 out_cache_loc: torch.Tensor, bufs: DecodeBuffers) -> tuple[DecodeWrite, PagedPlan]:
    """store: QuantizedKVStore (its frame tags and page generations are updated here, once per batch);
    req_pool_indices, seq_lens (length after the new token), out_cache_loc: [B] on the store's device."""
    G = store.G
    bs = req_pool_indices.shape[0]
    if bs > bufs.max_bs:
        raise ValueError(f"sgl_kvq: decode batch of {bs} requests exceeds the metadata capacity {bufs.max_bs}")
    write, plan = bufs.views(bs)
    req = req_pool_indices.long()
    lens = seq_lens.long()
    slots = out_cache_loc.long()
    pages, offs = slots // G, slots % G
    lpage = (lens - 1) // G
    # begin: one token per request, so frames never collide within the batch (padded rows share slot 0's frame).
    store.page_gen.index_add_(0, pages, (offs == 0).long())
    frames = store.frames.of(req, lpage)
    store.ov_tag[frames] = pages
    store.ov_gen[frames] = store.page_gen[pages]
    write.frame_ids.copy_(frames)
    write.frame_offs.copy_(offs)
    write.done_pages.copy_(torch.where(offs == G - 1, pages, torch.zeros_like(pages)))
    store.pages_quantized += (write.done_pages != 0).sum()  # padded rows complete no page (page 0)
    write.done_lpages.copy_(torch.where(offs == G - 1, lpage, torch.zeros_like(lpage)))

    # plan: page table [B, max_pages] of pool page ids (SGLang's allocator: position p sits in slot page * G + p % G)
    n_pages = lpage + 1
    table = req_to_token[req][:, bufs.page_cols * G].long() // G
    # overlay candidates: the last `ring` logical pages, newest first; a frame is valid while its tag and
    # generation still name the page's current contents
    cand = n_pages[:, None] - 1 - bufs.ring_cols[None, :]  # [B, ring]
    in_ctx = cand >= 0
    cand_c = cand.clamp(min=0)
    cand_page = table.gather(1, cand_c)
    cand_frame = store.frames.of(req[:, None], cand_c)
    valid = in_ctx & (store.ov_tag[cand_frame] == cand_page) & (store.ov_gen[cand_frame] == store.page_gen[cand_page])
    n_ov = valid.long().cumprod(1).sum(1)  # longest valid suffix
    n_base = n_pages - n_ov
    tail = lens - (n_pages - 1) * G
    plan.kv_indptr[1:].copy_(n_base.cumsum(0))
    plan.ov_indptr[1:].copy_(n_ov.cumsum(0))
    plan.kv_last_page_len.copy_(torch.where(n_ov > 0, torch.full_like(tail, G), tail))
    plan.ov_last_page_len.copy_(torch.where(n_ov > 0, tail, torch.zeros_like(tail)))
    trash_kv, trash_ov = bufs.kv_indices.numel() - 1, bufs.ov_indices.numel() - 1
    col = bufs.page_cols[None, :]
    dest = torch.where(col < n_base[:, None], plan.kv_indptr[:-1, None].long() + col, trash_kv)
    bufs.kv_indices.scatter_(0, dest.reshape(-1), table.to(torch.int32).reshape(-1))
    # overlay frames in position order: logical pages n_base .. n_pages - 1
    ov_page = n_base[:, None] + bufs.ring_cols[None, :]
    dest = torch.where(bufs.ring_cols[None, :] < n_ov[:, None], plan.ov_indptr[:-1, None].long() + bufs.ring_cols,
                       trash_ov)
    bufs.ov_indices.scatter_(0, dest.reshape(-1), store.frames.of(req[:, None], ov_page).to(torch.int32).reshape(-1))
    return write, plan
