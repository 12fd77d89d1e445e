"""The quantized KV store: packed low-bit pages (the base) plus per-request fp16 overlay frames.

Pure torch (no SGLang imports): the SGLang pool adapter (sgl_kvq/pool.py) and the backends drive it, tests drive it
directly. Layout and invariants are in sgl_kvq/layout.py. One batch goes through it as:

    batch = store.begin_batch(slots, req_slots, positions, seq_lens_after)   # once per forward, all layers
    for each layer:  (extend) attend with the pre-batch plan, then store.write_layer(layer, batch, k, v)
                     (decode) store.write_layer(layer, batch, k, v), then attend with the post-batch plan

Frames are layer-independent metadata (tags, generations) updated once per batch in begin_batch; their contents
are per layer and written in write_layer. A page is quantized into the base in the batch that writes its last slot,
from its fp16 tokens (earlier batches' tokens from its frame, this batch's from k/v), so every page the radix tree
can see is complete and already quantized: prefix reuse never re-quantizes.
"""

from __future__ import annotations

import torch

from sgl_kvq.config import KVQConfig
from sgl_kvq.layout import PoolShape
from sgl_kvq.plan import BatchWrite, LayerKV, PagedPlan
from sgl_kvq.quant import kivi_page


class QuantizedKVStore:
    def __init__(self, cfg: KVQConfig, shape: PoolShape, num_req_slots: int, model_dtype: torch.dtype,
                 device: str | torch.device):
        cfg.check_head_dim(shape.head_dim)
        self.cfg, self.shape = cfg, shape
        self.G, self.ring = cfg.group_size, cfg.ring_pages
        self.model_dtype = model_dtype
        self.device = torch.device(device)
        self.num_req_slots = num_req_slots  # SGLang's req_pool_idx range, slot 0 included
        for name, (dims, dtype) in shape.base_shapes().items():
            setattr(self, name, torch.zeros(dims, dtype=dtype, device=self.device))
        L, H, D = shape.layers, shape.heads, shape.head_dim
        F = num_req_slots * self.ring
        self.ov_k = torch.zeros((L, F, self.G, H, D), dtype=model_dtype, device=self.device)
        self.ov_v = torch.zeros_like(self.ov_k)
        self.ov_tag = torch.full((F,), -1, dtype=torch.int64, device=self.device)
        self.ov_gen = torch.zeros(F, dtype=torch.int64, device=self.device)
        self.page_gen = torch.zeros(shape.P, dtype=torch.int64, device=self.device)

    # ---- byte accounting (what is really allocated) ----
    def base_bytes(self) -> int:
        return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in self.shape.base_shapes())

    def overlay_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ov_k, self.ov_v, self.ov_tag, self.ov_gen))

    def frame(self, req_slot: torch.Tensor, logical_page: torch.Tensor) -> torch.Tensor:
        return req_slot * self.ring + logical_page % self.ring

    # ---- per batch ----
    def begin_batch(self, slots: torch.Tensor, req_slots: torch.Tensor, positions: torch.Tensor,
                    seq_lens_after: torch.Tensor) -> BatchWrite:
        """slots/req_slots/positions: [T] per written token; seq_lens_after: [T] the length of the token's request
        after this batch (decides which of its tokens stay in the fp16 window)."""
        G = self.G
        slots, req_slots, positions = slots.long(), req_slots.long(), positions.long()
        pages, offs = slots // G, slots % G
        if bool(((positions % G) != offs).any()):
            raise AssertionError("sgl_kvq: token slot offsets do not follow position % G (page size != G?)")
        lpage = positions // G
        frames = self.frame(req_slots, lpage)
        # A freed page that is reused starts at offset 0: bump its generation so stale frames stop matching it.
        starts = pages[offs == 0]
        self.page_gen[starts] += 1
        # Tokens in the request's last `ring` pages stay in the overlay; older ones would be overwritten in this same
        # batch (their frame is reused by a later page) so they go straight to the base.
        last_lpage = (seq_lens_after.long() - 1) // G
        keep = lpage > last_lpage - self.ring
        frame_rows = keep.nonzero().squeeze(1)
        kf, kp = frames[frame_rows], pages[frame_rows]
        self.ov_tag[kf] = kp
        self.ov_gen[kf] = self.page_gen[kp]
        # Pages completed by this batch: the batch wrote their last slot.
        done_rows = (offs == G - 1).nonzero().squeeze(1)
        done_pages = pages[done_rows]
        done_frames = frames[done_rows]
        tok_in_done = torch.isin(pages, done_pages)
        done_tok_rows = tok_in_done.nonzero().squeeze(1)
        page_index = {int(p): i for i, p in enumerate(done_pages.tolist())}
        done_tok_page = torch.tensor([page_index[int(p)] for p in pages[done_tok_rows].tolist()], dtype=torch.int64,
                                     device=self.device)
        return BatchWrite(slots, frame_rows, kf, offs[frame_rows], done_pages, done_frames, done_tok_rows,
                          done_tok_page, offs[done_tok_rows])

    def write_layer(self, layer: int, bw: BatchWrite, k: torch.Tensor, v: torch.Tensor, kernels: bool = False) -> None:
        """k, v: [T, H, D] this batch's fresh keys/values for `layer`. kernels=True quantizes and scatters with the
        Triton kernels (bit-exact with the torch path, tests/test_kernels_quantize.py)."""
        if bw.done_pages.numel():
            # Earlier batches' tokens of a completing page are in its frame (same request, and its frame is reused
            # only by a later page); this batch's tokens come from k/v. A page begun in this batch writes every
            # offset, so its frame's stale rows are all overwritten. Read frames before this layer writes them.
            kp = self.ov_k[layer, bw.done_frames].clone()
            vp = self.ov_v[layer, bw.done_frames].clone()
            kp[bw.done_tok_page, bw.done_tok_off] = k[bw.done_tok_rows].to(kp.dtype)
            vp[bw.done_tok_page, bw.done_tok_off] = v[bw.done_tok_rows].to(vp.dtype)
            if kernels:
                from sgl_kvq.kernels.quantize_pages import quantize_pages

                quantize_pages(kp, vp, bw.done_pages.to(torch.int32), self.layer_view(layer),
                               specache_one_bit=self.cfg.specache_one_bit)
            else:
                self.store_pages(layer, bw.done_pages, kp, vp)
        if bw.frame_rows.numel():
            if kernels:
                from sgl_kvq.kernels.store_overlay import store_overlay

                store_overlay(k[bw.frame_rows], v[bw.frame_rows], bw.frame_ids.to(torch.int32),
                              bw.frame_offs.to(torch.int32), self.layer_view(layer))
            else:
                self.ov_k[layer, bw.frame_ids, bw.frame_offs] = k[bw.frame_rows].to(self.model_dtype)
                self.ov_v[layer, bw.frame_ids, bw.frame_offs] = v[bw.frame_rows].to(self.model_dtype)

    def write_decode_layer(self, layer: int, dw, k: torch.Tensor, v: torch.Tensor) -> None:
        """A decode batch's write with the Triton kernels, static shapes and no host sync (CUDA graphs): every row
        into its frame, then each page a row completed quantized from that frame. dw: decode_metadata.DecodeWrite.
        Bit-exact with write_layer on the same batch (tests/test_decode_metadata.py)."""
        from sgl_kvq.kernels.quantize_pages import quantize_pages
        from sgl_kvq.kernels.store_overlay import store_overlay

        kv = self.layer_view(layer)
        store_overlay(k, v, dw.frame_ids, dw.frame_offs, kv)
        quantize_pages(kv.ov_k, kv.ov_v, dw.done_pages, kv, src_ids=dw.frame_ids,
                       specache_one_bit=self.cfg.specache_one_bit)

    def store_pages(self, layer: int, pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize complete pages k, v [N, G, H, D] into the base at pool pages `pages`."""
        p = kivi_page.quantize_pages(k, v, self.cfg.bits, self.shape.VG, self.cfg.specache_one_bit)
        G = self.G
        slots = (pages[:, None] * G + torch.arange(G, device=pages.device)).reshape(-1)
        n = pages.numel()
        self.k_codes[layer, slots] = p.k_codes.reshape(n * G, *p.k_codes.shape[2:])
        self.v_codes[layer, slots] = p.v_codes.reshape(n * G, *p.v_codes.shape[2:])
        self.v_scale[layer, slots] = p.v_scale.reshape(n * G, *p.v_scale.shape[2:])
        self.v_zero[layer, slots] = p.v_zero.reshape(n * G, *p.v_zero.shape[2:])
        self.k_scale[layer, pages] = p.k_scale
        self.k_zero[layer, pages] = p.k_zero

    # ---- reads ----
    def plan(self, page_tables: list[torch.Tensor], req_slots: list[int], seq_lens: list[int],
             query_pos: list[int] | None = None) -> PagedPlan:
        """FlashInfer-style plan for requests whose contexts are the first seq_lens[b] positions of page_tables[b]
        (pool page ids of logical pages 0, 1, ...). Pages of the fp16 window of a query at query_pos[b] (default:
        the context's last position, as in decode) whose frames still hold them (tag and generation match) are
        read from the overlay, as the longest such suffix; the rest from the packed base."""
        G, ring = self.G, self.ring
        kv_indptr, kv_indices, kv_last, ov_indptr, ov_indices, ov_last = [0], [], [], [0], [], []
        tags, gens, pgen = self.ov_tag.tolist(), self.ov_gen.tolist(), self.page_gen
        query_pos = query_pos or [n - 1 for n in seq_lens]
        for pages, r, n_tok, qp in zip(page_tables, req_slots, seq_lens, query_pos):
            n_pages = -(-n_tok // G)
            pages = pages[:n_pages].tolist()
            n_ov = 0
            for n in range(n_pages - 1, max(qp // G - ring + 1, 0) - 1, -1):
                f = r * ring + n % ring
                if tags[f] != pages[n] or gens[f] != int(pgen[pages[n]]):
                    break
                n_ov += 1
            n_base = n_pages - n_ov
            tail = n_tok - (n_pages - 1) * G if n_pages else 0
            if n_ov == 0 and tail != G and n_pages:
                raise RuntimeError(f"sgl_kvq: request slot {r}: its open page {pages[-1]} has no fp16 frame "
                                   "(pool state inconsistent)")
            kv_indices += pages[:n_base]
            kv_indptr.append(len(kv_indices))
            kv_last.append(G if n_ov else (tail if n_base else 0))
            ov_indices += [r * ring + n % ring for n in range(n_base, n_pages)]
            ov_indptr.append(len(ov_indices))
            ov_last.append(tail if n_ov else 0)

        def i32(x):
            return torch.tensor(x, dtype=torch.int32, device=self.device)

        return PagedPlan(i32(kv_indptr), i32(kv_indices), i32(kv_last), i32(ov_indptr), i32(ov_indices), i32(ov_last))

    def layer_view(self, layer: int) -> LayerKV:
        return LayerKV(self.k_codes[layer], self.k_scale[layer], self.k_zero[layer], self.v_codes[layer],
                       self.v_scale[layer], self.v_zero[layer], self.ov_k[layer], self.ov_v[layer], self.cfg.bits)
