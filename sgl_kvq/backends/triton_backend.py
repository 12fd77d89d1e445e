"""kvq_triton: fused-dequant Triton kernels over the packed pages (sgl_kvq/kernels); the default on CUDA.

The per-batch plan (pages, frames, split counts, workspaces) is built once in init_forward_metadata and reused by
every layer (FlashInfer's plan/run split); attention reads packed codes and dequantizes in registers."""

from __future__ import annotations

from sgl_kvq.backends.torch_backend import KVQAttentionBackendBase
from sgl_kvq.kernels import decode_attention as decode_kernel
from sgl_kvq.kernels.extend_attention import extend_attention


class KVQTritonBackend(KVQAttentionBackendBase):
    name = "kvq_triton"
    write_kernels = True

    def __init__(self, model_runner):
        super().__init__(model_runner)
        self.decode_plan = None

    def init_forward_metadata(self, forward_batch):
        super().init_forward_metadata(forward_batch)
        self.decode_plan = None  # built by the first layer (which knows the query heads), reused by the rest

    def extend(self, q, k, v, li, step, sm_scale):
        return extend_attention(q.contiguous(), k.contiguous(), v.contiguous(), step.qo_indptr,
                                self.store.layer_view(li), step.plan, sm_scale, max_qo_len=step.max_qo_len)

    def decode(self, q, li, step, sm_scale):
        if self.decode_plan is None:
            self.decode_plan = decode_kernel.plan(step.plan, num_qo_heads=q.shape[1], num_kv_heads=self.store.shape.heads,
                                                  head_dim=self.store.shape.head_dim, page_size=self.store.G)
        return decode_kernel.decode_attention(q.contiguous(), self.store.layer_view(li), self.decode_plan, sm_scale)
