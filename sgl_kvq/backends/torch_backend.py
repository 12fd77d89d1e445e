"""kvq_torch: the torch attention backend over the quantized pool; any device, the CPU default.

Decode takes one of three paths per batch, by one rule (sgl_kvq/decode_paths.py): the compiled C kernel for KIVI's
plain pages on a CPU (KVQ_CPU_KERNEL, where a C compiler is found), page by page (sgl_kvq/attention_pages.py) on
ragged or long batches of plain pages, else a padded dequantized layout (sgl_kvq/attention_batched.py); what a path
derives from the plan is built once per batch. Extend runs torch's fused attention per request
(sgl_kvq/attention_extend.py), a paged prefill as one step per layer. All read only the pages the batch references,
never the pool; sgl_kvq/attention_ref.py is the oracle of every one."""

from __future__ import annotations

import contextlib
import logging

import torch

from sgl_kvq import attention_extend, decode_paths, padded
from sgl_kvq.attention_ref import frame_rows
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
    paged_in_one_step = True

    def __init__(self, model_runner):
        super().__init__(model_runner)
        # The current decode batch's plan and what its first layer derived from it for the others to reuse
        self._plan_derived: tuple[object, dict] = (None, {})
        self._workspace = padded.Workspace()  # the K/V buffers every layer and step reuses
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

    def prefix_frames(self, li, step):
        kv = self.store.layer_view(li)
        return [frame_rows(kv, step.plan, b) for b in range(step.plan.batch_size)]

    def extend_paged(self, q, k, v, li, step, sm_scale, window, frames):
        return attention_extend.extend_paged(q, k, v, step.qo_indptr, self.store.layer_view(li), step.plan,
                                             step.reread, sm_scale, frames, window=window)

    def _derived(self, plan, name, build):
        if self._plan_derived[0] is not plan:
            self._plan_derived = (plan, {})
        derived = self._plan_derived[1]
        if name not in derived:
            derived[name] = build()
        return derived[name]

    def batched_context(self, plan) -> padded.BatchedContext:
        """The padded layout of a decode plan, prepared by its first layer and reused by the others."""
        return self._derived(plan, "padded", lambda: padded.prepare(plan, self.store.G,
                                                                               self.store.shape.heads))

    def decode_path(self, plan, kv) -> tuple[str, object]:
        """A decode batch's path (sgl_kvq/decode_paths.py's rule) and what it derives from the plan, chosen and
        built by the first layer and reused by the others; counted once per batch."""
        def build():
            path = decode_paths.choose(kv, plan, self.store.G, self._cpu_kernel)
            self.pool.decode_batches[path] += 1
            if path == decode_paths.PADDED:
                return path, self.batched_context(plan)  # shared with the padded layout's other readers
            return path, decode_paths.prepare(path, plan, self.store.G, self.store.shape.heads)

        return self._derived(plan, "decode", build)

    def attention_threads(self):
        """The decode attention's intra-op thread limit (KVQConfig.attention_threads says why), as a context."""
        return intra_op_threads(self.store.cfg.attention_threads, self.store.device)

    def decode(self, q, li, step, sm_scale, window):
        kv = self.store.layer_view(li)
        with self.attention_threads():
            path, prepared = self.decode_path(step.plan, kv)
            check = False
            if path == decode_paths.CPU_KERNEL:  # its layout check, once per layer view
                check = li not in self._checked_layers
                self._checked_layers.add(li)
            return decode_paths.decode(path, q, kv, step.plan, prepared, sm_scale, self._workspace, window=window,
                                       check=check)

    def support_triton(self):
        return False
