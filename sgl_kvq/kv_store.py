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

What a format adds to a page (its extra tensors, its per-frame state, how its pages are compressed and what the
write needs for it: ZipCache's queries, LogQuant's logical page indices) is declared by the format
(sgl_kvq/formats/); the store allocates and writes what the declaration names.
"""

from __future__ import annotations

import torch

from sgl_kvq.config import KVQConfig
from sgl_kvq.formats.page_codec import PageWrite
from sgl_kvq.frames import FrameTable, frame_view
from sgl_kvq.layer_tensors import LayerTensors
from sgl_kvq.plan import BatchWrite, DecodeWrite, LayerKV
from sgl_kvq.pool_shape import PoolShape


class QuantizedKVStore:
    def __init__(self, cfg: KVQConfig, shape: PoolShape, num_req_slots: int, model_dtype: torch.dtype,
                 device: str | torch.device, *, frames_pooled: bool = False, extra_frames: int = 0):
        """frames_pooled: the overlay frames live in the pool's pages, handed out per running request (frames.py);
        else a separate region with `ring` frames per request slot. extra_frames (pooled only): frames a running
        request takes beyond its ring for its decode strategy's state (SpeCache's top-k rows)."""
        cfg.check_head_dim(shape.head_dim)
        self.cfg, self.shape = cfg, shape
        self.format = cfg.format
        self.G, self.ring = cfg.group_size, cfg.ring_pages
        self.model_dtype = model_dtype
        self.device = torch.device(device)
        self.num_req_slots = num_req_slots  # SGLang's req_pool_idx range, slot 0 included
        L, H, D = shape.layers, shape.heads, shape.head_dim
        for name, (dims, dtype) in shape.layer_shapes(0).items():
            per_layer = [shape.layer_shapes(layer)[name][0] for layer in range(L)]
            if all(d == dims for d in per_layer):
                setattr(self, name, torch.zeros((L, *dims), dtype=dtype, device=self.device))
            else:  # a recipe's code widths: one tensor per layer, indexed as [L, ...] is
                setattr(self, name, LayerTensors.zeros(per_layer, dtype, self.device))
        self.frames_pooled = frames_pooled
        if frames_pooled:
            k = shape.pages_per_frame(model_dtype)
            if shape.P % k:
                raise AssertionError(f"sgl_kvq: {shape.P} pool pages are not whole frames of {k} pages")
            F = shape.P // k
            self.ov_k, self.ov_v = (frame_view(c, F, self.G, H, D, model_dtype) if isinstance(c, torch.Tensor)
                                    else LayerTensors([frame_view(t, F, self.G, H, D, model_dtype) for t in c.layers])
                                    for c in (self.k_codes, self.v_codes))
        else:
            F = num_req_slots * self.ring
            self.ov_k = torch.zeros((L, F, self.G, H, D), dtype=model_dtype, device=self.device)
            self.ov_v = torch.zeros_like(self.ov_k)
        self.frames = FrameTable(num_req_slots, self.ring, F, self.device, pooled=frames_pooled, extra=extra_frames)
        self.ov_tag = torch.full((F,), -1, dtype=torch.int64, device=self.device)
        self.ov_gen = torch.zeros(F, dtype=torch.int64, device=self.device)
        self.page_gen = torch.zeros(shape.P, dtype=torch.int64, device=self.device)
        # Pages this store quantized into the base (each once, when a batch writes its last slot), exported with
        # the pool's stats. A device scalar: the decode builder adds to it inside CUDA graphs, without a host sync.
        self.pages_quantized = torch.zeros((), dtype=torch.int64, device=self.device)
        # PD only: how many of a slot's frames hold its request (sgl_kvq/pd_transfer.py), sent with the frames
        self.pd_window = torch.zeros(num_req_slots, dtype=torch.int64, device=self.device)
        self.frame_state = tuple(shape.frame_state_shapes())  # the format's per-frame state, [L, F, ...]
        for name, (dims, dtype) in shape.frame_state_shapes().items():
            setattr(self, name, torch.zeros((L, F, *dims), dtype=dtype, device=self.device))
        self.extra_names = tuple(shape.extra_shapes())
        # extras stored per token slot ([S, ...]) rather than per page
        self.per_slot = {n for n, (dims, _) in shape.layer_shapes(0).items() if dims[0] != shape.P}
        self.tables = self.format.codec.tables(cfg, shape.geometry, self.device)

    # ---- byte accounting (what is really allocated) ----
    def base_bytes(self) -> int:
        return sum(getattr(self, n).numel() * getattr(self, n).element_size() for n in self.shape.base_names())

    def overlay_bytes(self) -> int:
        """Bytes allocated for the overlay beyond the base (pooled frames are the base's own pages)."""
        frames = () if self.frames_pooled else (self.ov_k, self.ov_v)
        extra = tuple(getattr(self, n) for n in self.frame_state)
        return sum(t.numel() * t.element_size() for t in (*frames, self.ov_tag, self.ov_gen, *extra))

    # ---- writes (where tokens go: sgl_kvq.metadata) ----
    def _need_q(self, q, sm_scale) -> None:
        if self.format.codec.needs_queries and (q is None or sm_scale is None):
            raise ValueError(f"sgl_kvq: {self.cfg.name} writes need the batch's queries and sm_scale (q=, sm_scale=)")

    def write_layer(self, layer: int, bw: BatchWrite, k: torch.Tensor, v: torch.Tensor, *,
                    kernels: bool = False, q: torch.Tensor | None = None, sm_scale: float | None = None) -> None:
        """k, v: [T, H, D] this batch's fresh keys/values for `layer` (q [T, Hq, D] its queries, for formats whose
        write needs them). kernels=True quantizes and scatters with the Triton kernels (bit-exact with the torch
        path, tests/kernels/test_kernels_quantize.py) where the format's codes are the quantize kernel's."""
        self._need_q(q, sm_scale)
        fmt = self.format
        kernels = kernels and fmt.kernel is not None and fmt.kernel.quantize
        if bw.done_pages.numel():
            # Earlier batches' tokens of a completing page are in its frame (same request, and its frame is reused
            # only by a later page); this batch's tokens come from k/v. A page begun in this batch writes every
            # offset, so its frame's stale rows are all overwritten. Read frames before this layer writes them
            # (indexing by a tensor copies them).
            kp = self.ov_k[layer, bw.done_frames]
            vp = self.ov_v[layer, bw.done_frames]
            kp[bw.done_tok_page, bw.done_tok_off] = k[bw.done_tok_rows].to(kp.dtype)
            vp[bw.done_tok_page, bw.done_tok_off] = v[bw.done_tok_rows].to(vp.dtype)
            if kernels:  # imported where a kernel runs: a kvq_torch process never imports Triton
                from sgl_kvq.kernels.quantize_pages import quantize_pages

                quantize_pages(kp, vp, bw.done_pages.to(torch.int32), self.layer_view(layer),
                               specache_one_bit=self.cfg.specache_one_bit)
                extras = fmt.kernel.written_extras(bw.done_pages, bw.done_lpages, lambda: (kp, vp), self.tables)
                self._store_extras(layer, bw.done_pages, extras)
            else:
                w = fmt.codec.page_write(self, layer, bw, q, kp, sm_scale, PageWrite(bw.done_pages, bw.done_lpages))
                self._store(layer, kp, vp, w)
        if bw.frame_rows.numel():
            if kernels:
                from sgl_kvq.kernels.store_overlay import store_overlay

                store_overlay(k[bw.frame_rows], v[bw.frame_rows], bw.frame_ids.to(torch.int32),
                              bw.frame_offs.to(torch.int32), self.layer_view(layer))
            else:
                self.ov_k[layer, bw.frame_ids, bw.frame_offs] = k[bw.frame_rows].to(self.model_dtype)
                self.ov_v[layer, bw.frame_ids, bw.frame_offs] = v[bw.frame_rows].to(self.model_dtype)
            fmt.codec.batch_frames_written(self, layer, bw, q, sm_scale)

    def write_decode_layer(self, layer: int, dw: DecodeWrite, k: torch.Tensor, v: torch.Tensor, *,
                           q: torch.Tensor | None = None, sm_scale: float | None = None,
                           v_rotation: torch.Tensor | None = None) -> None:
        """A decode batch's write with the Triton kernels, static shapes and no host sync (CUDA graphs): every row
        into its frame, then each page a row completed quantized from that frame (dw: metadata.device.build_decode).
        Bit-exact with write_layer on the same batch (tests/unit/test_decode_metadata.py). v_rotation: R [D, D]
        fp32, the values stored as v @ R by the frame write (KVQ_ROTATE=values fused; every page is then packed
        from rotated frames)."""
        from sgl_kvq.kernels.quantize_pages import quantize_pages
        from sgl_kvq.kernels.store_overlay import store_overlay

        self._need_q(q, sm_scale)
        fmt = self.format
        kv = self.layer_view(layer)
        store_overlay(k, v, dw.frame_ids, dw.frame_offs, kv, v_rotation=v_rotation)
        received = fmt.codec.decode_frames_written(self, layer, dw, q, sm_scale)
        if fmt.kernel is not None and fmt.kernel.quantize:
            quantize_pages(kv.ov_k, kv.ov_v, dw.done_pages, kv, src_ids=dw.frame_ids,
                           specache_one_bit=self.cfg.specache_one_bit)

            def frames_kv():
                frames = dw.frame_ids.long()
                return kv.ov_k[frames], kv.ov_v[frames]

            extras = fmt.kernel.written_extras(dw.done_pages, dw.done_lpages, frames_kv, self.tables)
            if extras is not None:
                self._store_extras(layer, dw.done_pages.long(), extras)
            return
        # Every row's frame is compressed (static shapes, no sync); rows that complete no page write dummy page 0,
        # which no plan reads.
        frames = dw.frame_ids.long()
        group = 1 if q is None else q.shape[1] // k.shape[1]
        self.store_pages(layer, dw.done_pages.long(), kv.ov_k[frames], kv.ov_v[frames], lpages=dw.done_lpages,
                         received=received, group=group)

    def store_pages(self, layer: int, pages: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    lpages: torch.Tensor | None = None, received: torch.Tensor | None = None,
                    group: int = 1) -> None:
        """Quantize complete pages k, v [N, G, H, D] into the base at pool pages `pages`, with what the format's
        write needs (formats.page_codec.PageWrite: lpages [N], their logical page indices; received [N, G, H], the
        attention each token received from all of its page's queries, over `group` query heads per KV head)."""
        self._store(layer, k, v, PageWrite(pages, lpages, received, group))

    def _store(self, layer: int, k: torch.Tensor, v: torch.Tensor, w: PageWrite) -> None:
        w = w._replace(bits=self.shape.layer_bits(layer))
        base, extras = self.format.codec.pack(self.cfg, self.shape.VG, k, v, w, self.tables)
        self._store_named(layer, w.pages, base._fields, base)
        if extras is not None:
            self._store_named(layer, w.pages, self.extra_names, extras)

    def _store_extras(self, layer: int, pages: torch.Tensor, extras: tuple | None) -> None:
        if extras is not None:
            self._store_named(layer, pages, self.extra_names, extras)

    def _store_named(self, layer: int, pages: torch.Tensor, names: tuple[str, ...], tensors: tuple) -> None:
        """Pages `pages` [N] of a format's tensors in the pages' form ([N, ...]; per-slot ones [N, G, ...]) into the
        pool's tensors of the same names: the base a format's pack returns (KIVI's PackedPages or a format's own,
        named as its base_shapes) and its extras go the same way."""
        G, n = self.G, pages.numel()
        slots = None
        for name, t in zip(names, tensors):
            if name in self.per_slot:
                if slots is None:
                    slots = (pages[:, None] * G + torch.arange(G, device=pages.device)).reshape(-1)
                getattr(self, name)[layer, slots] = t.reshape(n * G, *t.shape[2:])
            else:
                getattr(self, name)[layer, pages] = t

    def layer_view(self, layer: int) -> LayerKV:
        extras = None
        if self.format.extras is not None:
            extras = self.format.extras(*(getattr(self, n)[layer] for n in self.extra_names))

        def kivi(name):  # a base that is not KIVI's has no scales or zeros of these names (Format.base_shapes)
            t = getattr(self, name, None)
            return None if t is None else t[layer]

        return LayerKV(self.k_codes[layer], kivi("k_scale"), kivi("k_zero"), self.v_codes[layer],
                       kivi("v_scale"), kivi("v_zero"), self.ov_k[layer], self.ov_v[layer],
                       *self.shape.layer_bits(layer), extras)
