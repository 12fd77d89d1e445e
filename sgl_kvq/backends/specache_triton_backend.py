"""kvq_triton for the specache dtypes: the same lanes, host tier and extend semantics as kvq_torch's
(specache_backend.py). The two-lane decode is planned on the device (kvq_triton's build_decode over the real rows; both
lanes read its entries, tests/unit/test_specache_decode_metadata.py) and both lanes run in one fused kernel per layer
(sgl_kvq/kernels/specache_decode.py): packed pages and fp16 frames are read in registers for both rows of a request, the
prefetched 16-bit top-k rows replace their positions, and the speculative row's next top-k is selected on the device
(select_topk), so the next step's prefetch (HostTier.prefetch: a copy stream, one event per layer) is issued without a
host sync and overlaps the next layer's compute. The pre-decode keeps the host-built read-only plan. Writes use the
Triton store/quantize kernels (bit-exact with torch's).

Extends run eagerly, as kvq_triton's do, in kvq_triton's fused extend kernel: a cached prefix read in 16 bits from the
host tier (the default) is staged per layer as fp16 frames of a plan with no base pages (sgl_kvq/specache/
prefix_frames.py); with KVQ_SPECACHE_PREFIX=device the kernel reads the prefix as stored. Decode runs eagerly too:
the lanes hook is on SGLang's eager decode forward (patches/eager_decode.py), so patches/resolution.py turns
decode CUDA graphs off for specache. A sliding-window layer's window reaches the extend kernel, the lanes' kernel and
select_topk (kernels/specache_decode.py).
"""

from __future__ import annotations

import dataclasses

import torch

from sgl_kvq.backends.base import query_heads_on_this_rank, sliding_window
from sgl_kvq.backends.specache_backend import KVQSpeCacheBackend
from sgl_kvq.kernels import specache_decode as sd
from sgl_kvq.kernels.extend_attention import extend_attention
from sgl_kvq.metadata.device import DecodeBuffers, build_decode
from sgl_kvq.plan import ForwardPlan, Step
from sgl_kvq.specache import prefix_frames


class KVQSpeCacheTritonBackend(KVQSpeCacheBackend):
    name = "kvq_triton"
    write_kernels = True

    def __init__(self, model_runner):
        super().__init__(model_runner)
        self.num_qo_heads = query_heads_on_this_rank(model_runner)
        self.lane_plan: sd.SpeCachePlan | None = None
        self.scores: torch.Tensor | None = None
        self.prefix_frames: prefix_frames.PrefixFrames | None = None  # an extend's 16-bit prefix as frames
        self.follow = False  # this step stores the output lane's scores too (KVQ_SPECACHE_FOLLOW, two-lane steps)
        self.write_slots: torch.Tensor | None = None  # pool slots of the two-lane step's real rows
        self.decode_bufs = DecodeBuffers(self.req_to_token.shape[0], -(-self.req_to_token.shape[1] // self.store.G),
                                         self.store.ring, self.store.device)

    def init_forward_metadata(self, forward_batch):
        self.sc.fence()
        lanes = self.sc.lanes
        if forward_batch.forward_mode.is_decode() and lanes is not None and lanes.kind == "two_lane":
            # kvq_triton's device-built decode metadata over the real rows: both lanes read its plan entries
            n = lanes.n_real
            self.write_slots = forward_batch.out_cache_loc[:n]
            write, paged = build_decode(self.store, self.req_to_token, forward_batch.req_pool_indices,
                                        forward_batch.seq_lens, self.write_slots, self.decode_bufs)
            self.forward_plan = ForwardPlan(is_decode=True, steps=[Step(plan=paged, write=write)])
            self.req = forward_batch.req_pool_indices.long()
        else:
            super().init_forward_metadata(forward_batch)
        if not forward_batch.forward_mode.is_decode():
            self.lane_plan = self.scores = None
            if forward_batch.forward_mode.is_extend() and self.store.cfg.params.prefix == "host":
                self.prefix_frames = prefix_frames.build(self.prefix_slots, self.store.G, self.store.device)
            return
        s = self.store.shape
        self.lane_plan = sd.plan(self.forward_plan.steps[0].plan, n_lanes=2 if lanes.kind == "two_lane" else 1,
                                 num_qo_heads=self.num_qo_heads, num_kv_heads=s.heads, head_dim=s.head_dim,
                                 page_size=self.store.G)
        # The scores cover every base position of the batch: no request's context is longer than its seq_len
        # (host-side in SGLang's batch), so the bound needs no device sync.
        lens = getattr(forward_batch, "seq_lens_cpu", None)
        T = int(lens.max()) if lens is not None and lens.numel() else self.req_to_token.shape[1]
        self.follow = bool(self.store.cfg.params.follow) and lanes.kind == "two_lane"
        rows = self.lane_plan.batch_size * (2 if self.follow else 1)  # with follow, the output lane's scores too
        self.scores = torch.empty(rows, self.num_qo_heads, max(T, 1), dtype=torch.float32, device=self.store.device)

    def attend_extend(self, q, k, v, layer, forward_batch, save_kv_cache):
        q, k, v, li = self._views(q, k, v, layer)
        step = self.forward_plan.steps[0]  # specache extends are "full" (config.py): one step
        kv, plan = self.store.layer_view(li), step.plan  # KVQ_SPECACHE_PREFIX=device: the prefix as stored
        if self.store.cfg.params.prefix == "host":  # its 16-bit rows as frames; no base page is read
            ov_k, ov_v = prefix_frames.stage(self.prefix_frames, self.sc.host, li)
            kv, plan = dataclasses.replace(kv, ov_k=ov_k, ov_v=ov_v), self.prefix_frames.plan
        out = extend_attention(q.contiguous(), k.contiguous(), v.contiguous(), step.qo_indptr, kv, plan,
                               layer.scaling, max_qo_len=step.max_qo_len, window=sliding_window(layer))
        if save_kv_cache:
            self.store.write_layer(li, step.write, k, v, kernels=True)
            self.sc.host.write(li, step.write.slots, k, v)
        return out.reshape(q.shape[0], -1)

    def attend_decode(self, q, k, v, layer, forward_batch, save_kv_cache):
        q, k, v, li = self._views(q, k, v, layer)
        sc, step, p = self.sc, self.forward_plan.steps[0], self.lane_plan
        kv = self.store.layer_view(li)  # views of the pool: they read this step's write below
        H = self.store.shape.heads
        window = sliding_window(layer)
        first = sd.window_first(p, window)
        if sc.lanes.kind == "predecode":
            out, lse = sd.specache_decode(q.contiguous(), k.contiguous(), v.contiguous(), kv, p, None,
                                          layer.scaling, self.scores, window=window)
            sc.prefetch(li, self.req, sd.select_topk(self.scores, lse, p.base_tokens, H, sc.top_k, first=first),
                        self.req_to_token)
            return out.reshape(q.shape[0], -1)
        n = sc.lanes.n_real
        if save_kv_cache:
            self.store.write_decode_layer(li, step.write, k[:n], v[:n])
            sc.host.write(li, self.write_slots, k[:n], v[:n])
        sc.host.wait(li)
        if sc.recall:
            self._count_recall(q[:n], li, step.plan, layer.scaling, window)
        topk = sd.TopK(*sc.topk.layer(li), self.req, sc.top_k)
        out, lse = sd.specache_decode(q.contiguous(), k[n:].contiguous(), v[n:].contiguous(), kv, p, topk,
                                      layer.scaling, self.scores, follow=self.follow, window=window)
        s = self.scores
        if self.follow:  # lane-major: the output rows' scores first
            pos = sd.select_topk(s[n:], lse[n:], p.base_tokens, H, sc.top_k, follow=(s[:n], lse[:n]), first=first)
        else:
            pos = sd.select_topk(s, lse[n:], p.base_tokens, H, sc.top_k, first=first)
        sc.prefetch(li, self.req, pos, self.req_to_token)
        return out.reshape(q.shape[0], -1)
