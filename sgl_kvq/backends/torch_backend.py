"""kvq_torch: the reference attention backend over the quantized pool; any device, the CPU default.

It dequantizes per request, only the pages that request references (sgl_kvq/attention_ref.py), never the pool."""

from __future__ import annotations

from sgl_kvq import attention_ref
from sgl_kvq.backends.base import KVQAttentionBackendBase


class KVQTorchBackend(KVQAttentionBackendBase):
    name = "kvq_torch"

    def extend(self, q, k, v, li, step, sm_scale):
        return attention_ref.ref_extend(q, k, v, step.qo_indptr, self.store.layer_view(li), step.plan, sm_scale)

    def decode(self, q, li, step, sm_scale):
        return attention_ref.ref_decode(q, self.store.layer_view(li), step.plan, sm_scale)

    def support_triton(self):
        return False
