"""How the packed pool describes itself to SGLang's prefill/decode KV transfer (sglang/srt/disaggregation/).

SGLang's transfer backends (mooncake, nixl, ...) read `(data_ptrs, data_lens, item_lens)` from the pool's
get_contiguous_buf_infos() and move a request's pages as `ptr + page_index * item_len`, `item_len * run` bytes per
run of consecutive pages, pairing the prefill side's entry i with the decode side's entry i (plain MHA: the first
half of the entries with the first half, the second half with the second). Every buffer PoolShape.base_shapes
lists is [L, P or S, ...] with page p's rows contiguous in each layer (S = P * G slots, page p = slots p*G ..
p*G+G-1), so each (buffer, layer) is one entry whose item is one page's bytes of it: codes, scales, zeros and every
format's extras (GEAR's factors and outliers, LogQuant's row slots, ZipCache's salient plane) travel packed.

The open page and the fp16 window are not in the base: they are the request's overlay frames (layout.py), owned by
its request slot, which differs between the two servers. They are sent, not recomputed: SGLang's decode server runs
no forward over prompt tokens (it starts from the first output token), so a recomputed open page would need a
prefill step the decode side does not have. request_state_buf_infos() describes them like SGLang's per-request
state buffers (indexed by req_pool_idx: item = one slot's `ring` frames of a layer), and adopt_frames() re-points
the decode slot's frames at the decode side's pages once they have arrived. Their cost per request is `ring` pages
of model-dtype K/V (R + G tokens at bf16 size), whatever the prompt length.

Not every one of the last `ring` pages has its frame on the prefill side: a page that was a radix hit was written
by another request, so this request's frame for it holds something else and both sides must read that page from the
base. The prefill side counts the frames that hold the request's pages (mark_window: the longest valid suffix, the
rule plan_contexts reads by) into the slot's `pd_window` entry, which travels with the frames; the decode side adopts
exactly that many (adopt_frames).

In SGLang the frames are one REQUEST_ROW state component (sent row to row: item i of the prefill's slot to item i of
the decode's slot), with a model layer id per entry so mooncake pairs entries one to one (flat) instead of splitting
the list into K and V halves.
"""

from __future__ import annotations

import torch

from sgl_kvq.metadata.host import frames_holding


def base_entries(store) -> list[torch.Tensor]:
    """One page-indexed tensor per (base buffer, layer), buffer-major. An odd count (e.g. LogQuant's 9 buffers
    over an odd number of layers) repeats the smallest entry: SGLang's MHA pairing splits the list in two halves,
    and sending the same bytes twice is harmless."""
    entries = [getattr(store, name)[layer] for name in store.shape.base_names()
               for layer in range(store.shape.layers)]
    if len(entries) % 2:
        entries.append(min(entries, key=lambda t: t.nbytes))
    return entries


def buf_infos(entries: list[torch.Tensor], items: int) -> tuple[list[int], list[int], list[int]]:
    """(data_ptrs, data_lens, item_lens) over entries of `items` equal items each (pages, or request slots)."""
    for t in entries:
        if not t.is_contiguous() or t.nbytes % items:
            raise AssertionError(f"sgl_kvq: a transfer entry {tuple(t.shape)} is not {items} contiguous items")
    return [t.data_ptr() for t in entries], [t.nbytes for t in entries], [t.nbytes // items for t in entries]


def base_buf_infos(store) -> tuple[list[int], list[int], list[int]]:
    return buf_infos(base_entries(store), store.shape.P)


def request_state_entries(store) -> list[torch.Tensor]:
    """The overlay frames per layer (with the format's per-frame state: zipcache2's saliency accumulator), item = one
    request slot's `ring` consecutive frames (frame_of: slot r owns frames r*ring .. r*ring+ring-1), then the slots'
    pd_window counts (item = one slot's count)."""
    names = ("ov_k", "ov_v", *store.frame_state)
    return [getattr(store, n)[layer] for n in names for layer in range(store.shape.layers)] + [store.pd_window]


def request_state_layer_ids(store, start_layer: int = 0) -> list[int]:
    """The model layer of each request_state_entries entry (the pd_window counts: the first layer's)."""
    per = 2 + len(store.frame_state)
    return [start_layer + layer for _ in range(per) for layer in range(store.shape.layers)] + [start_layer]


def request_state_buf_infos(store) -> tuple[list[int], list[int], list[int]]:
    if store.frames_pooled:
        raise AssertionError("sgl_kvq: prefill/decode transfer sends a slot's frames as one row: they must be static")
    return buf_infos(request_state_entries(store), store.num_req_slots)


def window_pages(store, req_slot: int, pages: torch.Tensor, seq_len: int) -> int:
    """How many of the request's last `ring` logical pages (pool pages `pages` of logical pages 0, 1, ...) its
    frames hold: the suffix plan_contexts reads from the overlay for a decode at the context's end."""
    n_pages = -(-seq_len // store.G)
    return frames_holding(store.ov_tag, store.ov_gen, store.page_gen, store.frames, req_slot, pages, n_pages,
                          max(n_pages - store.ring, 0))


def mark_window(store, req_slot: int, pages: torch.Tensor, seq_len: int) -> None:
    """Prefill side, before the request's state is sent: record in the slot's pd_window how many frames hold it."""
    store.pd_window[req_slot] = window_pages(store, req_slot, pages, seq_len)


def adopt_frames(store, req_slot: int, pages: torch.Tensor, seq_len: int) -> None:
    """Decode side, after a request's pages and state arrived: mark the frames of its last pd_window[req_slot]
    logical pages (those the prefill side held in fp16) as holding this side's pages `pages` (pool page ids of
    logical pages 0, 1, ...), at their current generation; the other frames of the slot are emptied."""
    G, ring = store.G, store.ring
    n_pages = -(-seq_len // G)
    held = int(store.pd_window[req_slot])
    if not 0 <= held <= min(ring, n_pages):
        raise RuntimeError(f"sgl_kvq: request slot {req_slot} received pd_window {held} for {n_pages} pages "
                           f"(ring {ring}): the request state did not arrive intact")
    for n in range(max(n_pages - ring, 0), n_pages):
        f, p = store.frames.of_host(req_slot, n), int(pages[n])
        store.ov_tag[f] = p if n >= n_pages - held else -1
        store.ov_gen[f] = store.page_gen[p]
