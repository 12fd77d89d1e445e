"""kvq_torch: the torch attention backend over the quantized pool; any device, the CPU default.

Decode of the codes-scales-zeros formats (kivi) on a CPU runs the compiled C kernel (kernels/cpu_decode_attention.c;
KVQ_CPU_KERNEL, where a C compiler is found). Otherwise it runs batched with its index built once per batch: page
by page with the scales folded into the query and the weights (sgl_kvq/attention_pages.py) for formats whose pages
are codes, scales and zeros, on batches where that does less work (ragged or long contexts), else over a padded
dequantized layout (sgl_kvq/attention_batched.py). Extend runs torch's fused attention per request
(sgl_kvq/attention_extend.py). All read only the pages the batch references, never the pool;
sgl_kvq/attention_ref.py is the oracle of every one."""

from __future__ import annotations

import contextlib
import logging

import torch

from sgl_kvq import attention_batched, attention_extend, attention_pages
from sgl_kvq.backends.base import KVQAttentionBackendBase
from sgl_kvq.kernels import cpu_decode_attention

logger = logging.getLogger(__name__)


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
    sliding_windows = True

    def __init__(self, model_runner):
        super().__init__(model_runner)
        # The current decode batch's plan and what its first layer derived from it for the others to reuse
        self._plan_derived: tuple[object, dict] = (None, {})
        self._workspace = attention_batched.Workspace()  # the K/V buffers every layer and step reuses
        self._cpu_kernel = self._use_cpu_kernel()
        self._checked_layers: set[int] = set()  # layer views the C kernel's layout check has passed

    def _use_cpu_kernel(self) -> bool:
        """Whether decode of a kivi format runs the C kernel (built here, once per machine, about 2 s)."""
        cfg = self.store.cfg
        if not cfg.cpu_kernel or self.store.device.type != "cpu":
            return False
        if cpu_decode_attention.available():
            return True
        logger.warning("sgl_kvq: kvq_torch decodes with its torch paths: %s (KVQ_CPU_KERNEL=0 silences this)",
                       cpu_decode_attention.unavailable_reason())
        return False

    def extend(self, q, k, v, li, step, sm_scale, window):
        return attention_extend.extend(q, k, v, step.qo_indptr, self.store.layer_view(li), step.plan, sm_scale,
                                       window=window)

    def _derived(self, plan, name, build):
        if self._plan_derived[0] is not plan:
            self._plan_derived = (plan, {})
        derived = self._plan_derived[1]
        if name not in derived:
            derived[name] = build()
        return derived[name]

    def batched_context(self, plan) -> attention_batched.BatchedContext:
        """The padded layout of a decode plan, prepared by its first layer and reused by the others."""
        return self._derived(plan, "padded", lambda: attention_batched.prepare(plan, self.store.G,
                                                                               self.store.shape.heads))

    def decode_index(self, plan, kv) -> attention_pages.PageIndex | attention_batched.BatchedContext:
        """A decode plan's index for the path that does less work on it (attention_pages.pays_off; formats with
        per-page extras always take the padded one), built by the first layer and reused by the others."""
        def build():
            G, H = self.store.G, self.store.shape.heads
            if attention_pages.supports(kv) and attention_pages.pays_off(plan, G):
                self.pool.decode_batches["pages"] += 1
                return attention_pages.index(plan, G, H)
            self.pool.decode_batches["padded"] += 1
            return self.batched_context(plan)

        return self._derived(plan, "decode", build)

    def _count_cpu_kernel_batch(self) -> None:
        self.pool.decode_batches["cpu_kernel"] += 1

    def attention_threads(self):
        """The decode attention's intra-op thread limit (KVQConfig.attention_threads says why), as a context."""
        return intra_op_threads(self.store.cfg.attention_threads, self.store.device)

    def decode(self, q, li, step, sm_scale, window):
        kv = self.store.layer_view(li)
        if self._cpu_kernel and cpu_decode_attention.supports(kv):
            self._derived(step.plan, "decode", self._count_cpu_kernel_batch)  # batches, not layers
            check = li not in self._checked_layers
            self._checked_layers.add(li)
            with self.attention_threads():
                return cpu_decode_attention.decode_attention(q.contiguous(), kv, step.plan, sm_scale, check=check,
                                                             window=window)
        with self.attention_threads():
            idx = self.decode_index(step.plan, kv)
            path = attention_pages if isinstance(idx, attention_pages.PageIndex) else attention_batched
            return path.decode(q, kv, idx, sm_scale, self._workspace, window=window)

    def support_triton(self):
        return False
