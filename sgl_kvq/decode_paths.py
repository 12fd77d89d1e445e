"""kvq_torch's decode paths behind one interface, and the one rule that picks a batch's path.

    cpu_kernel  kernels/cpu_decode_attention.c: the packed codes read in C, one pass; KIVI's plain pages on a CPU
    pages       attention_pages.py: page by page, scales folded into the query and the weights; plain pages
    padded      attention_batched.py: the batch dequantized into a padded layout, then the format's correction;
                every format (per-page extras, a peer's own base)

The rule (`choose`): the C kernel wherever it is built and enabled and the format's pages are plain; else the page
path where the pages are plain and the batch is one it runs faster (attention_pages.pays_off: ragged or long
batches); else the padded path. Every path computes attention_ref.ref_decode (tests/unit/test_format_matrix.py
checks each against it for every dtype of the registry), so the rule decides speed only.
"""

from __future__ import annotations

import torch

from sgl_kvq import attention_batched, attention_pages, padded
from sgl_kvq.kernels import cpu_decode_attention
from sgl_kvq.plan import LayerKV, PagedPlan

CPU_KERNEL, PAGES, PADDED = "cpu_kernel", "pages", "padded"
PATHS = (CPU_KERNEL, PAGES, PADDED)


def applies(path: str, kv: LayerKV) -> bool:
    """Whether `path` can read layer view kv at all (whatever it costs)."""
    if path == CPU_KERNEL:
        return cpu_decode_attention.supports(kv) and cpu_decode_attention.available()
    if path == PAGES:
        return attention_pages.supports(kv)
    return True


def choose(kv: LayerKV, plan: PagedPlan, G: int, cpu_kernel: bool) -> str:
    """The path a decode batch takes (the rule above); cpu_kernel: the server may use the C kernel (built, on a
    CPU, KVQ_CPU_KERNEL on). kv: any layer's view (every layer of a pool holds the same format)."""
    if cpu_kernel and cpu_decode_attention.supports(kv):
        return CPU_KERNEL
    if attention_pages.supports(kv) and attention_pages.pays_off(plan, G):
        return PAGES
    return PADDED


def prepare(path: str, plan: PagedPlan, G: int, H: int):
    """What `path` derives from a batch's plan once, for every layer to reuse (None: the C kernel reads the plan)."""
    if path == CPU_KERNEL:
        return None
    if path == PAGES:
        return attention_pages.index(plan, G, H)
    return padded.prepare(plan, G, H)


def decode(path: str, q: torch.Tensor, kv: LayerKV, plan: PagedPlan, prepared, sm_scale: float,
           ws: padded.Workspace | None = None, window: int = -1, check: bool = True) -> torch.Tensor:
    """q [B, Hq, D], one query per request, over its context in kv through `path` -> [B, Hq, D] in q's dtype.
    prepared: prepare(path, plan, ...); check=False: the C kernel skips the layout check of a view it has seen."""
    if path == CPU_KERNEL:
        return cpu_decode_attention.decode_attention(q.contiguous(), kv, plan, sm_scale, check=check, window=window)
    module = attention_pages if path == PAGES else attention_batched
    return module.decode(q, kv, prepared, sm_scale, ws, window=window)
