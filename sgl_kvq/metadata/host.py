"""Host-side metadata of one batch over a QuantizedKVStore: where its tokens go (begin_batch -> BatchWrite) and
what each request attends to (plan_contexts -> PagedPlan). Any batch shape (decode, extend, a paged-prefill step);
reads tensors back to the host (.tolist()), so it runs eagerly only. The reference of the device-side decode
builder (sgl_kvq/metadata/device.py); sgl_kvq/metadata/forward.py composes the two into a forward's steps.

Frames are layer-independent metadata (tags, generations) updated once per batch in begin_batch; their contents are
per layer and written by QuantizedKVStore.write_layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sgl_kvq.plan import BatchWrite, PagedPlan

if TYPE_CHECKING:
    from sgl_kvq.kv_store import QuantizedKVStore


def begin_batch(store: QuantizedKVStore, slots: torch.Tensor, req_slots: torch.Tensor, positions: torch.Tensor,
                seq_lens_after: torch.Tensor) -> BatchWrite:
    """slots/req_slots/positions: [T] per written token; seq_lens_after: [T] the length of the token's request
    after this batch (decides which of its tokens stay in the fp16 window)."""
    G = store.G
    slots, req_slots, positions = slots.long(), req_slots.long(), positions.long()
    pages, offs = slots // G, slots % G
    if bool(((positions % G) != offs).any()):
        raise AssertionError("sgl_kvq: token slot offsets do not follow position % G (page size != G?)")
    lpage = positions // G
    for r in set(req_slots.tolist()):
        if not store.frames.holds(r):
            raise RuntimeError(f"sgl_kvq: request slot {r} writes KV but holds no overlay frames (its slot was not "
                               "allocated through SGLang's alloc_req_slots)")
    frames = store.frames.of(req_slots, lpage)
    # A freed page that is reused starts at offset 0: bump its generation so stale frames stop matching it.
    starts = pages[offs == 0]
    store.page_gen[starts] += 1
    # Tokens in the request's last `ring` pages stay in the overlay; older ones would be overwritten in this same
    # batch (their frame is reused by a later page) so they go straight to the base.
    last_lpage = (seq_lens_after.long() - 1) // G
    keep = lpage > last_lpage - store.ring
    frame_rows = keep.nonzero().squeeze(1)
    kf, kp = frames[frame_rows], pages[frame_rows]
    store.ov_tag[kf] = kp
    store.ov_gen[kf] = store.page_gen[kp]
    # Pages completed by this batch: the batch wrote their last slot.
    done_rows = (offs == G - 1).nonzero().squeeze(1)
    done_pages = pages[done_rows]
    store.pages_quantized += done_pages.numel()
    done_frames = frames[done_rows]
    tok_in_done = torch.isin(pages, done_pages)
    done_tok_rows = tok_in_done.nonzero().squeeze(1)
    page_index = {int(p): i for i, p in enumerate(done_pages.tolist())}
    done_tok_page = torch.tensor([page_index[int(p)] for p in pages[done_tok_rows].tolist()], dtype=torch.int64,
                                 device=store.device)
    return BatchWrite(slots=slots, frame_rows=frame_rows, frame_ids=kf, frame_offs=offs[frame_rows],
                      done_pages=done_pages, done_frames=done_frames, done_tok_rows=done_tok_rows,
                      done_tok_page=done_tok_page, done_tok_off=offs[done_tok_rows], done_lpages=lpage[done_rows])


def frames_holding(tags, gens, page_gen, frames, req_slot: int, pages, n_pages: int, lowest: int) -> int:
    """How many of logical pages n_pages-1, n_pages-2, ... (down to `lowest`) the slot's frames still hold (tag and
    generation match the pool page `pages[n]`), as the longest such suffix: the pages a context reads from the
    overlay. tags/gens: the store's ov_tag/ov_gen (lists or tensors), page_gen: its page_gen, frames: its
    FrameTable."""
    held = 0
    for n in range(n_pages - 1, lowest - 1, -1):
        f, p = frames.of_host(req_slot, n), int(pages[n])
        if int(tags[f]) != p or int(gens[f]) != int(page_gen[p]):
            break
        held += 1
    return held


def plan_contexts(store: QuantizedKVStore, page_tables: list[torch.Tensor], req_slots: list[int], seq_lens: list[int],
                  *, query_pos: list[int] | None = None) -> PagedPlan:
    """FlashInfer-style plan for requests whose contexts are the first seq_lens[b] positions of page_tables[b]
    (pool page ids of logical pages 0, 1, ...). Pages of the fp16 window of a query at query_pos[b] (default:
    the context's last position, as in decode) whose frames still hold them (tag and generation match) are
    read from the overlay, as the longest such suffix; the rest from the packed base."""
    G, ring = store.G, store.ring
    kv_indptr, kv_indices, kv_last, ov_indptr, ov_indices, ov_last = [0], [], [], [0], [], []
    tags, gens, pgen = store.ov_tag.tolist(), store.ov_gen.tolist(), store.page_gen
    query_pos = query_pos or [n - 1 for n in seq_lens]
    for pages, r, n_tok, qp in zip(page_tables, req_slots, seq_lens, query_pos):
        n_pages = -(-n_tok // G)
        pages = pages[:n_pages].tolist()
        n_ov = frames_holding(tags, gens, pgen, store.frames, r, pages, n_pages, max(qp // G - ring + 1, 0))
        n_base = n_pages - n_ov
        tail = n_tok - (n_pages - 1) * G if n_pages else 0
        if n_ov == 0 and tail != G and n_pages:
            raise RuntimeError(f"sgl_kvq: request slot {r}: its open page {pages[-1]} has no fp16 frame "
                               "(pool state inconsistent)")
        kv_indices += pages[:n_base]
        kv_indptr.append(len(kv_indices))
        kv_last.append(G if n_ov else (tail if n_base else 0))
        ov_indices += [store.frames.of_host(r, n) for n in range(n_base, n_pages)]
        ov_indptr.append(len(ov_indices))
        ov_last.append(tail if n_ov else 0)

    def i32(x):
        return torch.tensor(x, dtype=torch.int32, device=store.device)

    return PagedPlan(i32(kv_indptr), i32(kv_indices), i32(kv_last), i32(ov_indptr), i32(ov_indices), i32(ov_last))
