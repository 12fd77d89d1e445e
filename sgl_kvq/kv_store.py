"""The quantized KV store: packed low-bit pages (the base) plus per-request fp16 overlay frames.

Pure torch (no SGLang imports): the SGLang pool adapter (sgl_kvq/pool.py) and the backends drive it, tests drive it
directly. Layout and invariants are in sgl_kvq/layout.py. The store owns the tensors and the writes; where a
batch's tokens go and what each request reads is metadata built over it (sgl_kvq/metadata/). One batch goes
through it as:

    batch = metadata.host.begin_batch(store, slots, req_slots, positions, seq_lens_after)   # once per forward
    for each layer:  (extend) attend with the pre-batch plan, then store.write_layer(layer, batch, k, v)
                     (decode) store.write_layer(layer, batch, k, v), then attend with the post-batch plan

A page is quantized into the base in the batch that writes its last slot, from its fp16 tokens (earlier batches'
tokens from its frame, this batch's from k/v), so every page the radix tree can see is complete and already
quantized: prefix reuse never re-quantizes.

zipcache2 also needs each batch's queries (q=, sm_scale=): a page's salient tokens are picked, when it completes,
from the attention its own queries paid its tokens (sgl_kvq/quant/zipcache_page.py). Queries of earlier batches are
gone by then, so what they paid is accumulated per overlay frame (ov_score) as they are written; the completing batch
adds its own queries' share to the frame's total.
"""

from __future__ import annotations

import torch

from sgl_kvq.config import KVQConfig
from sgl_kvq.frames import FrameTable, frame_view
from sgl_kvq.layout import PoolShape
from sgl_kvq.plan import BatchWrite, DecodeWrite, LayerKV
from sgl_kvq.quant import gear_page, kivi_page, logquant_page, zipcache_page


class QuantizedKVStore:
    def __init__(self, cfg: KVQConfig, shape: PoolShape, num_req_slots: int, model_dtype: torch.dtype,
                 device: str | torch.device, *, frames_pooled: bool = False):
        """frames_pooled: the overlay frames live in the pool's pages, handed out per running request (frames.py);
        else a separate region with `ring` frames per request slot."""
        cfg.check_head_dim(shape.head_dim)
        self.cfg, self.shape = cfg, shape
        self.G, self.ring = cfg.group_size, cfg.ring_pages
        self.model_dtype = model_dtype
        self.device = torch.device(device)
        self.num_req_slots = num_req_slots  # SGLang's req_pool_idx range, slot 0 included
        for name, (dims, dtype) in shape.base_shapes().items():
            setattr(self, name, torch.zeros(dims, dtype=dtype, device=self.device))
        L, H, D = shape.layers, shape.heads, shape.head_dim
        self.frames_pooled = frames_pooled
        if frames_pooled:
            k = shape.pages_per_frame(model_dtype)
            if shape.P % k:
                raise AssertionError(f"sgl_kvq: {shape.P} pool pages are not whole frames of {k} pages")
            F = shape.P // k
            self.ov_k = frame_view(self.k_codes, F, self.G, H, D, model_dtype)
            self.ov_v = frame_view(self.v_codes, F, self.G, H, D, model_dtype)
        else:
            F = num_req_slots * self.ring
            self.ov_k = torch.zeros((L, F, self.G, H, D), dtype=model_dtype, device=self.device)
            self.ov_v = torch.zeros_like(self.ov_k)
        self.frames = FrameTable(num_req_slots, self.ring, F, self.device, pooled=frames_pooled)
        self.ov_tag = torch.full((F,), -1, dtype=torch.int64, device=self.device)
        self.ov_gen = torch.zeros(F, dtype=torch.int64, device=self.device)
        self.page_gen = torch.zeros(shape.P, dtype=torch.int64, device=self.device)
        # Pages this store quantized into the base (each once, when a batch writes its last slot), exported with
        # the pool's stats. A device scalar: the decode builder adds to it inside CUDA graphs, without a host sync.
        self.pages_quantized = torch.zeros((), dtype=torch.int64, device=self.device)
        # PD only: how many of a slot's frames hold its request (sgl_kvq/pd_transfer.py), sent with the frames
        self.pd_window = torch.zeros(num_req_slots, dtype=torch.int64, device=self.device)
        if cfg.is_zipcache:
            self.ov_score = torch.zeros((L, F, self.G, H), dtype=torch.float32, device=self.device)
        if cfg.has_rows:
            # LogQuant's row offsets per logical page: a request's logical pages never outnumber the pool's pages.
            self.row_table = logquant_page.offsets_table(cfg.logquant_window, self.G, self.ring, shape.P,
                                                         cfg.logquant_rows, self.device)

    # ---- byte accounting (what is really allocated) ----
    def base_bytes(self) -> int:
        return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in self.shape.base_shapes())

    def overlay_bytes(self) -> int:
        """Bytes allocated for the overlay beyond the base (pooled frames are the base's own pages)."""
        frames = () if self.frames_pooled else (self.ov_k, self.ov_v)
        extra = (self.ov_score,) if self.cfg.is_zipcache else ()
        return sum(t.numel() * t.element_size() for t in (*frames, self.ov_tag, self.ov_gen, *extra))

    # ---- writes (where tokens go: sgl_kvq.metadata) ----
    def _need_q(self, q, sm_scale) -> None:
        if self.cfg.is_zipcache and (q is None or sm_scale is None):
            raise ValueError("sgl_kvq: zipcache2 writes need the batch's queries and sm_scale (q=, sm_scale=)")

    def write_layer(self, layer: int, bw: BatchWrite, k: torch.Tensor, v: torch.Tensor, *,
                    kernels: bool = False, q: torch.Tensor | None = None, sm_scale: float | None = None) -> None:
        """k, v: [T, H, D] this batch's fresh keys/values for `layer` (q [T, Hq, D] its queries: zipcache2).
        kernels=True quantizes and scatters with the Triton kernels (bit-exact with the torch path,
        tests/test_kernels_quantize.py)."""
        self._need_q(q, sm_scale)
        # GEAR's and ZipCache's pages are compressed in torch on both backends
        kernels = kernels and not self.cfg.has_correction and not self.cfg.is_zipcache
        if bw.done_pages.numel():
            # Earlier batches' tokens of a completing page are in its frame (same request, and its frame is reused
            # only by a later page); this batch's tokens come from k/v. A page begun in this batch writes every
            # offset, so its frame's stale rows are all overwritten. Read frames before this layer writes them
            # (indexing by a tensor copies them).
            kp = self.ov_k[layer, bw.done_frames]
            vp = self.ov_v[layer, bw.done_frames]
            kp[bw.done_tok_page, bw.done_tok_off] = k[bw.done_tok_rows].to(kp.dtype)
            vp[bw.done_tok_page, bw.done_tok_off] = v[bw.done_tok_rows].to(vp.dtype)
            if kernels:
                from sgl_kvq.kernels.quantize_pages import quantize_pages

                quantize_pages(kp, vp, bw.done_pages.to(torch.int32), self.layer_view(layer),
                               specache_one_bit=self.cfg.specache_one_bit)
                self.store_rows(layer, bw.done_pages, bw.done_lpages, kp, vp)
            elif self.cfg.is_zipcache:
                self.store_pages(layer, bw.done_pages, kp, vp, received=self._done_received(layer, bw, q, kp, sm_scale),
                                 group=q.shape[1] // kp.shape[2])
            else:
                self.store_pages(layer, bw.done_pages, kp, vp, lpages=bw.done_lpages)
        if bw.frame_rows.numel():
            if kernels:
                from sgl_kvq.kernels.store_overlay import store_overlay

                store_overlay(k[bw.frame_rows], v[bw.frame_rows], bw.frame_ids.to(torch.int32),
                              bw.frame_offs.to(torch.int32), self.layer_view(layer))
            else:
                self.ov_k[layer, bw.frame_ids, bw.frame_offs] = k[bw.frame_rows].to(self.model_dtype)
                self.ov_v[layer, bw.frame_ids, bw.frame_offs] = v[bw.frame_rows].to(self.model_dtype)
            if self.cfg.is_zipcache:
                frames, inv = torch.unique(bw.frame_ids, return_inverse=True)
                self._accumulate(layer, frames, inv, bw.frame_offs, q[bw.frame_rows], sm_scale)

    # ---- zipcache2's saliency accumulator (ov_score) ----
    def _page_queries(self, n: int, tile: torch.Tensor, offs: torch.Tensor, q: torch.Tensor):
        """q rows [M, Hq, D] at (tile [M], offs [M]) -> by page offset [n, G, Hq, D] and which are present [n, G]."""
        qp = q.new_zeros(n, self.G, *q.shape[1:])
        qp[tile, offs] = q
        present = torch.zeros(n, self.G, dtype=torch.bool, device=q.device)
        present[tile, offs] = True
        return qp, present

    def _accumulate(self, layer: int, frames: torch.Tensor, tile: torch.Tensor, offs: torch.Tensor, q: torch.Tensor,
                    sm_scale: float) -> torch.Tensor:
        """Add what queries q [M, Hq, D] (already written to frames[tile] at offs) paid their pages' tokens to
        those frames' ov_score, which is reset first where offset 0 is written (a page starts). -> the totals."""
        n = frames.numel()
        qp, present = self._page_queries(n, tile, offs, q)
        recv = zipcache_page.received_attention(qp, present, self.ov_k[layer, frames], sm_scale)
        starts = torch.zeros(n, dtype=torch.int32, device=q.device).index_add_(0, tile, (offs == 0).int()) > 0
        total = torch.where(starts[:, None, None], 0.0, self.ov_score[layer, frames]) + recv
        self.ov_score[layer, frames] = total
        return total

    def _done_received(self, layer: int, bw: BatchWrite, q: torch.Tensor, kp: torch.Tensor,
                       sm_scale: float) -> torch.Tensor:
        """[N, G, H] attention each completing page's tokens received from all the page's queries: earlier batches'
        from the page's frame accumulator (read before this batch updates it), this batch's from kp."""
        n = bw.done_pages.numel()
        qp, present = self._page_queries(n, bw.done_tok_page, bw.done_tok_off, q[bw.done_tok_rows])
        recv = zipcache_page.received_attention(qp, present, kp, sm_scale)
        starts = torch.zeros(n, dtype=torch.int32, device=q.device).index_add_(
            0, bw.done_tok_page, (bw.done_tok_off == 0).int()) > 0
        return torch.where(starts[:, None, None], 0.0, self.ov_score[layer, bw.done_frames]) + recv

    def write_decode_layer(self, layer: int, dw: DecodeWrite, k: torch.Tensor, v: torch.Tensor, *,
                           q: torch.Tensor | None = None, sm_scale: float | None = None) -> None:
        """A decode batch's write with the Triton kernels, static shapes and no host sync (CUDA graphs): every row
        into its frame, then each page a row completed quantized from that frame (dw: metadata.device.build_decode).
        Bit-exact with write_layer on the same batch (tests/test_decode_metadata.py)."""
        from sgl_kvq.kernels.quantize_pages import quantize_pages
        from sgl_kvq.kernels.store_overlay import store_overlay

        self._need_q(q, sm_scale)
        kv = self.layer_view(layer)
        store_overlay(k, v, dw.frame_ids, dw.frame_offs, kv)
        if self.cfg.is_zipcache:
            # As GEAR below; every row's frame total is its page's score when the row completes it.
            frames = dw.frame_ids.long()
            rows = torch.arange(frames.numel(), device=frames.device)
            total = self._accumulate(layer, frames, rows, dw.frame_offs.long(), q, sm_scale)
            self.store_pages(layer, dw.done_pages.long(), kv.ov_k[frames], kv.ov_v[frames], received=total,
                             group=q.shape[1] // k.shape[1])
            return
        if self.cfg.has_correction:
            # Every row's frame is compressed (static shapes, no sync); rows that complete no page write dummy
            # page 0, which no plan reads.
            frames = dw.frame_ids.long()
            self.store_pages(layer, dw.done_pages.long(), kv.ov_k[frames], kv.ov_v[frames])
            return
        quantize_pages(kv.ov_k, kv.ov_v, dw.done_pages, kv, src_ids=dw.frame_ids,
                       specache_one_bit=self.cfg.specache_one_bit)
        if self.cfg.has_rows:
            # Every row's frame gives its rows (static shapes, no sync); rows that complete no page write dummy
            # page 0, which no plan reads.
            frames = dw.frame_ids.long()
            self.store_rows(layer, dw.done_pages.long(), dw.done_lpages.long(), kv.ov_k[frames], kv.ov_v[frames])

    def store_rows(self, layer: int, pages: torch.Tensor, lpages: torch.Tensor | None, k: torch.Tensor,
                   v: torch.Tensor) -> None:
        """LogQuant: copy the rows the rule keeps of complete pages k, v [N, G, H, D] (logical pages `lpages`) into
        the row slots of pool pages `pages`; nothing for other formats."""

        if not self.cfg.has_rows:
            return
        if lpages is None:
            raise ValueError("sgl_kvq: logquant2 pages need their logical page indices (lpages) to pick their rows")
        off = self.row_table[lpages.long()]
        self.k_rows[layer, pages], self.v_rows[layer, pages] = logquant_page.gather_rows(k, v, off)
        self.row_off[layer, pages] = off

    def store_pages(self, layer: int, pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    lpages: torch.Tensor | None = None, received: torch.Tensor | None = None,
                    group: int = 1) -> None:
        """Quantize complete pages k, v [N, G, H, D] into the base at pool pages `pages` (logquant2: lpages [N],
        their logical page indices, pick the rows kept in fp16; zipcache2: received [N, G, H], the attention each
        token received from all of its page's queries, over `group` query heads per KV head)."""
        cfg, G, n = self.cfg, self.G, pages.numel()
        slots = (pages[:, None] * G + torch.arange(G, device=pages.device)).reshape(-1)
        if cfg.is_zipcache:
            idx = zipcache_page.select_salient(zipcache_page.normalize(received, group), cfg.salient_per_page)
            p, s = zipcache_page.pack_zipcache_pages(k, v, idx, cfg.bits, self.shape.VG,
                                                     specache_one_bit=cfg.specache_one_bit)
            for name in zipcache_page.SalientPlane._fields:
                getattr(self, name)[layer, pages] = getattr(s, name)
        elif cfg.has_correction:
            p, c = gear_page.pack_gear_pages(k, v, cfg.bits, self.shape.VG, cfg.lowrank_rank, cfg.gear_iters,
                                             self.shape.NK, self.shape.NV, specache_one_bit=cfg.specache_one_bit)
            for name in ("k_u", "k_w", "v_u", "v_w", "k_out_val", "k_out_idx"):
                getattr(self, name)[layer, pages] = getattr(c, name)
            self.v_out_val[layer, slots] = c.v_out_val.reshape(n * G, *c.v_out_val.shape[2:])
            self.v_out_idx[layer, slots] = c.v_out_idx.reshape(n * G, *c.v_out_idx.shape[2:])
        else:
            p = kivi_page.pack_pages(k, v, cfg.bits, self.shape.VG, specache_one_bit=cfg.specache_one_bit)
        self.k_codes[layer, slots] = p.k_codes.reshape(n * G, *p.k_codes.shape[2:])
        self.v_codes[layer, slots] = p.v_codes.reshape(n * G, *p.v_codes.shape[2:])
        self.v_scale[layer, slots] = p.v_scale.reshape(n * G, *p.v_scale.shape[2:])
        self.v_zero[layer, slots] = p.v_zero.reshape(n * G, *p.v_zero.shape[2:])
        self.k_scale[layer, pages] = p.k_scale
        self.k_zero[layer, pages] = p.k_zero
        self.store_rows(layer, pages, lpages, k, v)

    def layer_view(self, layer: int) -> LayerKV:
        corr = None
        if self.cfg.has_correction:
            corr = gear_page.PageCorrection(*(getattr(self, f)[layer] for f in gear_page.PageCorrection._fields))
        rows = None
        if self.cfg.has_rows:
            rows = logquant_page.PageRows(self.k_rows[layer], self.v_rows[layer], self.row_off[layer])
        sal = None
        if self.cfg.is_zipcache:
            sal = zipcache_page.SalientPlane(*(getattr(self, f)[layer] for f in zipcache_page.SalientPlane._fields))
        return LayerKV(self.k_codes[layer], self.k_scale[layer], self.k_zero[layer], self.v_codes[layer],
                       self.v_scale[layer], self.v_zero[layer], self.ov_k[layer], self.ov_v[layer], self.cfg.bits,
                       corr, rows, sal)
