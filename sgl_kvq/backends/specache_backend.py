"""kvq_torch for the specache dtypes: KIVI's pool plus SpeCache's host tier and two decode lanes (sgl_kvq/specache).

Extend (prefill, a multi-turn continuation, a resumed request): the new tokens attend to the cached prefix in 16
bits, read back from the host tier (SpeCache's prefill is full precision; the host holds every token), or with
KVQ_SPECACHE_PREFIX=device from the low-bit pool as kivi reads it, and to each other; then they are written to the
packed base, the fp16 frames and the host tier.

Decode runs the rows sgl_kvq/specache/lanes.py put in the batch (state.lanes), batched over the requests
(sgl_kvq/specache/attention_batched.py, on kvq_torch's padded layout prepared once per step; its oracle is
sgl_kvq/specache/attention.py):
  two_lane   rows [0, n) the real tokens: written to the pool and the host tier, then attend to the low-bit base
             with the prefetched top-k rows in 16 bits; rows [n, 2n) their speculative tokens: attend to the same
             keys plus their own K/V, never written, and pick next step's top-k, prefetched per layer.
  predecode  a request's first decode step: its real token, read-only, as a speculative row (the paper's
             pre-decoding): picks the first top-k; specache/lanes.py takes its next-token guess.
A sliding-window layer's rows (extend, both lanes, the pre-decode) attend within the window, and the top-k is chosen
inside the window of the row that reads it next (sgl_kvq/specache/attention.py).
"""

from __future__ import annotations

import torch

from sgl_kvq import attention_extend
from sgl_kvq.attention_ref import visible_from
from sgl_kvq.backends.base import sliding_window
from sgl_kvq.backends.torch_backend import KVQTorchBackend
from sgl_kvq.metadata.forward import build_forward_plan, read_plan
from sgl_kvq.plan import ForwardPlan, Step
from sgl_kvq.specache import attention_batched as lanes_batched
from sgl_kvq.specache.attention import recall


class KVQSpeCacheBackend(KVQTorchBackend):
    sliding_windows = True  # the extend, both lanes and the top-k mask by a layer's window

    def __init__(self, model_runner):
        super().__init__(model_runner)
        self.sc = self.pool.strategy_state
        self.req = None  # request slots of the forward's real (or pre-decode) rows
        self.prefix_slots: list[torch.Tensor] = []

    def _use_cpu_kernel(self) -> bool:
        """Never: SpeCache's decode lanes (sgl_kvq/specache/) attend on the torch path."""
        return False

    def init_forward_metadata(self, forward_batch):
        self.sc.fence()
        mode = forward_batch.forward_mode
        if not mode.is_decode():
            super().init_forward_metadata(forward_batch)
            if mode.is_extend():
                reqs = forward_batch.req_pool_indices.tolist()
                self.sc.reset_requests(reqs)
                self.prefix_slots = [self.req_to_token[r, :n].long()
                                     for r, n in zip(reqs, forward_batch.extend_prefix_lens_cpu)]
            return
        lanes = self.sc.lanes
        if lanes is None:
            raise RuntimeError("sgl_kvq: a specache decode step ran without its lane hook (patches/eager_decode.py)")
        req = forward_batch.req_pool_indices
        if lanes.kind == "two_lane":
            n = lanes.n_real
            self.forward_plan = build_forward_plan(self.store, self.req_to_token, req, forward_batch.seq_lens,
                                                   forward_batch.out_cache_loc[:n], is_decode=True)
            self.req = req.long()
        else:
            req = req[lanes.rows]
            plan = read_plan(self.store, self.req_to_token, req, forward_batch.seq_lens[lanes.rows] - 1)
            self.forward_plan = ForwardPlan(is_decode=True, steps=[Step(plan=plan)])
            self.req = req.long()

    def attend_extend(self, q, k, v, layer, forward_batch, save_kv_cache):
        q, k, v, li = self._views(q, k, v, layer)
        step = self.forward_plan.steps[0]  # specache extends are "full" (config.py): one step
        contexts, at, window = None, None, sliding_window(layer)
        if self.store.cfg.params.prefix == "host":
            # a sliding layer reads from the host only the rows its window reaches
            at = [int(visible_from(s.numel(), window)) for s in self.prefix_slots]
            contexts = [self.sc.host.rows(li, s[a:]) for s, a in zip(self.prefix_slots, at)]
        out = attention_extend.extend(q, k, v, step.qo_indptr, self.store.layer_view(li), step.plan, layer.scaling,
                                      contexts=contexts, window=window, context_at=at)
        if save_kv_cache:
            self.store.write_layer(li, step.write, k, v, kernels=self.write_kernels)
            self.sc.host.write(li, step.write.slots, k, v)
        return out.reshape(q.shape[0], -1)

    def _count_recall(self, q, li: int, plan, sm_scale: float, window: int = -1) -> None:
        """The recall diagnostic (KVQ_SPECACHE_RECALL=1): the real rows q [n, Hq, D] against their exact top-k
        (within `window`) over the 16-bit context read back from the host tier (a full-context read per layer and
        step)."""
        sc, G = self.sc, self.store.G
        n = q.shape[0]
        lens = [plan.seq_len(b, G) for b in range(n)]
        exact = [sc.host.rows(li, self.req_to_token[r, :t].long()) for r, t in zip(self.req.tolist(), lens)]
        counts = recall(q, exact, [plan.base_len(b, G) for b in range(n)], sc.topk.positions(li, self.req), sm_scale,
                        window)
        sc.recall_hits += sum(h for h, _ in counts)
        sc.recall_wanted += sum(w for _, w in counts)

    def attend_decode(self, q, k, v, layer, forward_batch, save_kv_cache):
        q, k, v, li = self._views(q, k, v, layer)
        sc, step, window = self.sc, self.forward_plan.steps[0], sliding_window(layer)
        if sc.lanes.kind == "predecode":
            with self.attention_threads():
                out, pos = lanes_batched.predecode(q, k, v, self.store.layer_view(li),
                                                   self.batched_context(step.plan), layer.scaling, sc.top_k,
                                                   self._workspace, window)
            sc.prefetch(li, self.req, pos, self.req_to_token)
            return out.reshape(q.shape[0], -1)
        n = sc.lanes.n_real
        if save_kv_cache:
            self.store.write_layer(li, step.write, k[:n], v[:n])
            sc.host.write(li, step.write.slots, k[:n], v[:n])
        sc.host.wait(li)
        if sc.recall:
            self._count_recall(q[:n], li, step.plan, layer.scaling, window)
        topk_k, topk_v, topk_pos = sc.topk.rows(li, self.req)
        with self.attention_threads():
            out, pos = lanes_batched.two_lane(q, k[n:], v[n:], self.store.layer_view(li),
                                              self.batched_context(step.plan), layer.scaling, sc.top_k,
                                              topk_k, topk_v, topk_pos, bool(self.store.cfg.params.follow),
                                              self._workspace, window)
        sc.prefetch(li, self.req, pos, self.req_to_token)
        return out.reshape(q.shape[0], -1)
