"""The base class the kvq attention backends share (kvq_torch, kvq_triton and kvq_torch's specache subclass)."""

from __future__ import annotations

import abc

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from sgl_kvq import attention_rotation
from sgl_kvq.metadata.forward import build_forward_plan
from sgl_kvq.plan import ForwardPlan
from sgl_kvq.pool import KVQTokenToKVPool


def query_heads_on_this_rank(model_runner) -> int:
    """This rank's query heads (the pool holds its KV heads): the Triton kernels' launch shapes. Only the Triton
    backends ask, so kvq_torch builds without a published parallel config (its unit tests use a bare runner)."""
    from sglang.srt.runtime_context import get_parallel

    return model_runner.model_config.get_max_num_attention_heads() // get_parallel().attn_tp_size


def sliding_window(layer) -> int:
    """A layer's sliding window W (a query at position i sees i - W .. i: sgl_kvq/attention_ref.py), -1 for none."""
    w = layer.sliding_window_size
    return -1 if w is None or w < 0 else int(w)


class KVQAttentionBackendBase(AttentionBackend):
    """The forward plan built once per batch (sgl_kvq/metadata/), the write order per layer, the layer checks.
    Subclasses supply the attention compute (`extend`, `decode`) and whether writes use the Triton kernels, or
    override a whole layer (`attend_extend`, `attend_decode`); SGLang's forward_extend / forward_decode stay here,
    where KVQ_ROTATE's rotation is applied."""

    name = "kvq"
    write_kernels = False
    # whether every attention path of the backend masks by a layer's sliding window (all kvq backends do, SpeCache's
    # lanes included; a strategy that refuses windowed models before load would leave this False)
    sliding_windows = False
    # whether a paged prefill runs as one step attended after its write (extend_paged), else one step per page
    paged_in_one_step = False
    # whether the decode kernels apply KVQ_ROTATE=values themselves (V rotated as it is written, the output as it is
    # merged: attend_decode then takes q, k, v as the model computes them), else forward_decode rotates around them
    fused_decode_rotation = False

    def __init__(self, model_runner):
        super().__init__()
        pool = model_runner.token_to_kv_pool
        if not isinstance(pool, KVQTokenToKVPool):
            raise ValueError(f"sgl_kvq: the {self.name} attention backend needs a quantized KV cache "
                             f"(--kv-cache-dtype kivi2 ...); this server's pool is {type(pool).__name__}")
        self.pool = pool
        self.store = pool.store
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.forward_plan: ForwardPlan | None = None
        # KVQ_ROTATE (sgl_kvq/attention_rotation.py): v (and with "hadamard" q and k) rotated here, before anything is
        # written or read, and the output rotated back, so every path below sees the stored basis only
        self.rotation = attention_rotation.for_config(pool.cfg, pool.shape.head_dim, pool.store.device)
        # the values rotation the decode kernels apply themselves (fused_decode_rotation), None where they do not
        r = self.rotation
        self.kernel_rotation = r if self.fused_decode_rotation and r is not None and not r.keys else None

    def init_forward_metadata(self, forward_batch):
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.forward_plan = None
            return
        fb = forward_batch
        if mode.is_decode():
            self.forward_plan = build_forward_plan(self.store, self.req_to_token, fb.req_pool_indices, fb.seq_lens,
                                                   fb.out_cache_loc, is_decode=True)
        elif mode.is_extend() and not mode.is_mixed() and not mode.is_target_verify():
            self.forward_plan = build_forward_plan(self.store, self.req_to_token, fb.req_pool_indices, fb.seq_lens,
                                                   fb.out_cache_loc, is_decode=False,
                                                   extend_prefix_lens=fb.extend_prefix_lens_cpu,
                                                   extend_seq_lens=fb.extend_seq_lens_cpu,
                                                   page_steps=not self.paged_in_one_step)
        else:
            raise NotImplementedError(f"sgl_kvq: forward mode {mode.name} is not supported by {self.name}")

    def _check_layer(self, layer):
        if layer.is_cross_attention or (layer.logit_cap or 0) > 0 or layer.qk_head_dim != layer.v_head_dim:
            raise NotImplementedError("sgl_kvq: cross attention, logit caps and qk/v head dims that differ are not "
                                      "supported")
        if sliding_window(layer) >= 0 and not self.sliding_windows:
            raise NotImplementedError(f"sgl_kvq: {self.name} does not serve sliding-window layers")

    def _views(self, q, k, v, layer):
        self._check_layer(layer)
        q = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        if k is not None:
            k = k.reshape(-1, layer.tp_k_head_num, layer.qk_head_dim)
            v = v.reshape(-1, layer.tp_v_head_num, layer.v_head_dim)
        return q, k, v, self.pool.layer_index(layer.layer_id)

    # ---- SGLang's entry: KVQ_ROTATE's basis change, then the layer in the stored basis ----
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        r = self.rotation
        if r is None:
            return self.attend_extend(q, k, v, layer, forward_batch, save_kv_cache)
        return r.back(self.attend_extend(*r.inputs(q, k, v), layer, forward_batch, save_kv_cache))

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kwargs):
        r = self.rotation
        if r is None:
            return self.attend_decode(q, k, v, layer, forward_batch, save_kv_cache)
        if self.kernel_rotation is not None:
            return self.attend_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return r.back(self.attend_decode(*r.inputs(q, k, v), layer, forward_batch, save_kv_cache))

    # ---- one layer's write and attention over rows in the stored basis; subclasses override these ----
    def attend_extend(self, q, k, v, layer, forward_batch, save_kv_cache):
        q, k, v, li = self._views(q, k, v, layer)
        out = None
        for step in self.forward_plan.steps:
            sq, sk, sv = (q, k, v) if step.rows is None else (q[step.rows], k[step.rows], v[step.rows])
            if step.reread is None:
                # Attend first: the prefix's fp16 frames may be reused by this step's own tokens, so read them
                # before this layer's write (sgl_kvq/kv_store.py).
                o = self.extend(sq, sk, sv, li, step, layer.scaling, sliding_window(layer))
                if save_kv_cache:
                    self._write(li, step, sk, sv, sq, layer)
            else:
                # A paged prefill in one step: the prefix's frames read before the write (as above), everything
                # else after it, the step's own pages once their codes are written
                if not save_kv_cache:
                    raise NotImplementedError(f"sgl_kvq: {self.name}'s paged prefill attends to the codes it writes; "
                                              "an extend that does not save its KV needs KVQ_PREFILL=full")
                frames = self.prefix_frames(li, step)
                self._write(li, step, sk, sv, sq, layer)
                o = self.extend_paged(sq, sk, sv, li, step, layer.scaling, sliding_window(layer), frames)
            if step.rows is None:
                out = o
            else:
                if out is None:
                    out = o.new_empty(q.shape[0], *o.shape[1:])
                out[step.rows] = o
        return out.reshape(q.shape[0], -1)

    def _write(self, li, step, k, v, q, layer):
        self.store.write_layer(li, step.write, k, v, kernels=self.write_kernels, q=q,
                               sm_scale=layer.scaling)  # q: zipcache2's saliency

    def attend_decode(self, q, k, v, layer, forward_batch, save_kv_cache):
        q, k, v, li = self._views(q, k, v, layer)
        step = self.forward_plan.steps[0]
        if save_kv_cache:
            self.store.write_layer(li, step.write, k, v, kernels=self.write_kernels, q=q, sm_scale=layer.scaling)
        return self.decode(q, li, step, layer.scaling, sliding_window(layer)).reshape(q.shape[0], -1)

    @abc.abstractmethod
    def extend(self, q, k, v, li, step, sm_scale, window):
        """q [N, Hq, D], fresh k/v [N, H, D] -> [N, Hq, D]: the context before the step (step.plan) plus the
        step's own tokens, causally, within the sliding `window` (-1: none)."""

    def prefix_frames(self, li, step):
        """A paged one-step extend's prefix frames before its write, per request (paged_in_one_step)."""
        raise NotImplementedError(f"sgl_kvq: {self.name} runs a paged prefill in page steps")

    def extend_paged(self, q, k, v, li, step, sm_scale, window, frames):
        """A paged one-step extend after its write (paged_in_one_step): attention_extend.extend_paged's contract."""
        raise NotImplementedError(f"sgl_kvq: {self.name} runs a paged prefill in page steps")

    @abc.abstractmethod
    def decode(self, q, li, step, sm_scale, window):
        """q [B, Hq, D] -> [B, Hq, D] over each request's context (step.plan), within the sliding `window`."""
