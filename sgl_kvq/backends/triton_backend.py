"""kvq_triton: fused-dequant Triton kernels over the packed pages (sgl_kvq/kernels); the default on CUDA.

Decode builds its metadata on the device with fixed shapes (sgl_kvq/metadata/device.py) into buffers allocated
once, and plans split-KV into a fixed workspace, so the same code runs eagerly and inside SGLang's decode CUDA
graphs: `init_forward_metadata_in_graph` is recorded into the graph and replayed with it, reading the runner's
static req_pool_indices / seq_lens / out_cache_loc. Extend keeps the host-built plan (sgl_kvq/metadata/forward.py)
and runs eagerly. Attention reads packed codes and dequantizes in registers."""

from __future__ import annotations

from sgl_kvq.backends.base import KVQAttentionBackendBase, query_heads_on_this_rank, sliding_window
from sgl_kvq.kernels import decode_attention as decode_kernel
from sgl_kvq.kernels.extend_attention import extend_attention
from sgl_kvq.metadata.device import DecodeBuffers, build_decode
from sgl_kvq.plan import ForwardPlan, Step


class KVQTritonBackend(KVQAttentionBackendBase):
    name = "kvq_triton"
    write_kernels = True
    sliding_windows = True
    # KVQ_ROTATE=values in the decode kernels: V rotated by the overlay write, the output by the split merge
    fused_decode_rotation = True

    def __init__(self, model_runner):
        super().__init__(model_runner)
        self.num_qo_heads = query_heads_on_this_rank(model_runner)
        self.decode_plan = None
        self._allocate_decode_state(self.req_to_token.shape[0])

    def _allocate_decode_state(self, max_bs: int) -> None:
        s = self.store.shape
        max_pages = -(-self.req_to_token.shape[1] // self.store.G)
        self.decode_bufs = DecodeBuffers(max_bs, max_pages, self.store.ring, self.store.device)
        self.decode_ws = decode_kernel.DecodeWorkspace(max_bs, self.num_qo_heads, s.heads, s.head_dim,
                                                       self.store.device)

    # ---- SGLang's forward-metadata contract (eager = out_graph + in_graph) ----
    def init_forward_metadata(self, forward_batch):
        if forward_batch.forward_mode.is_decode():
            self.init_forward_metadata_out_graph(forward_batch)
            self.init_forward_metadata_in_graph(forward_batch)
        else:
            super().init_forward_metadata(forward_batch)
            self.decode_plan = None

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        if max_bs > self.decode_bufs.max_bs:
            self._allocate_decode_state(max_bs)

    def get_cuda_graph_seq_len_fill_value(self):
        return 1  # a padded row is a one-token context in request slot 0 / page 0 (metadata/device.py)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        if not forward_batch.forward_mode.is_decode():
            raise NotImplementedError(f"sgl_kvq: {self.name} captures decode CUDA graphs only, not "
                                      f"{forward_batch.forward_mode.name}")

    def init_forward_metadata_in_graph(self, forward_batch):
        write, paged = build_decode(self.store, self.req_to_token, forward_batch.req_pool_indices,
                                    forward_batch.seq_lens, forward_batch.out_cache_loc, self.decode_bufs)
        self.decode_plan = decode_kernel.plan(paged, num_qo_heads=self.num_qo_heads,
                                              num_kv_heads=self.store.shape.heads,
                                              head_dim=self.store.shape.head_dim, page_size=self.store.G,
                                              workspace=self.decode_ws)
        self.forward_plan = ForwardPlan(is_decode=True, steps=[Step(plan=paged, write=write)])

    # ---- compute ----
    def attend_decode(self, q, k, v, layer, forward_batch, save_kv_cache):
        q, k, v, li = self._views(q, k, v, layer)
        r = self.kernel_rotation
        if save_kv_cache:
            self.store.write_decode_layer(li, self.forward_plan.steps[0].write, k, v, q=q, sm_scale=layer.scaling,
                                          v_rotation=None if r is None else r.r)
        return self.decode(q, li, self.forward_plan.steps[0], layer.scaling, sliding_window(layer)).reshape(
            q.shape[0], -1)

    def extend(self, q, k, v, li, step, sm_scale, window):
        return extend_attention(q.contiguous(), k.contiguous(), v.contiguous(), step.qo_indptr,
                                self.store.layer_view(li), step.plan, sm_scale, max_qo_len=step.max_qo_len,
                                window=window)

    def decode(self, q, li, step, sm_scale, window):
        r = self.kernel_rotation  # the values rotation undone by the split merge
        return decode_kernel.decode_attention(q.contiguous(), self.store.layer_view(li), self.decode_plan, sm_scale,
                                              window=window, out_rotation=None if r is None else r.r_t)
