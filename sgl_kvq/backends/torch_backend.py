"""kvq_torch: the torch attention backend over the quantized pool; any device, the CPU default.

Decode runs batched (sgl_kvq/attention_batched.py: one padded attention over the batch, its index built once per
batch); extend runs torch's fused attention per request (sgl_kvq/attention_extend.py). Both dequantize only the
pages the batch references, never the pool; sgl_kvq/attention_ref.py is the oracle of both."""

from __future__ import annotations

import contextlib

import torch

from sgl_kvq import attention_batched, attention_extend
from sgl_kvq.backends.base import KVQAttentionBackendBase


@contextlib.contextmanager
def intra_op_threads(n: int, device: torch.device):
    """torch's intra-op thread count limited to n (> 0) on a CPU device for the block, then restored."""
    prev = torch.get_num_threads()
    if n <= 0 or device.type != "cpu" or prev <= n:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


class KVQTorchBackend(KVQAttentionBackendBase):
    name = "kvq_torch"

    def __init__(self, model_runner):
        super().__init__(model_runner)
        self._batched = None  # (plan, BatchedContext) of the current decode batch, shared by its layers
        self._workspace = attention_batched.Workspace()  # the padded K/V buffers every layer and step reuses

    def extend(self, q, k, v, li, step, sm_scale):
        return attention_extend.extend(q, k, v, step.qo_indptr, self.store.layer_view(li), step.plan, sm_scale)

    def batched_context(self, plan) -> attention_batched.BatchedContext:
        """The padded layout of a decode plan, prepared by its first layer and reused by the others."""
        if self._batched is None or self._batched[0] is not plan:
            self._batched = (plan, attention_batched.prepare(plan, self.store.G, self.store.shape.heads))
        return self._batched[1]

    def attention_threads(self):
        """The decode attention's intra-op thread limit (KVQConfig.attention_threads says why), as a context."""
        return intra_op_threads(self.store.cfg.attention_threads, self.store.device)

    def decode(self, q, li, step, sm_scale):
        with self.attention_threads():
            return attention_batched.decode(q, self.store.layer_view(li), self.batched_context(step.plan), sm_scale,
                                            self._workspace)

    def support_triton(self):
        return False
