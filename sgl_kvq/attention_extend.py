"""Extend attention over the packed paged base plus the fp16 overlay: the compute of `kvq_torch` extend.

Same result as attention_ref.ref_extend (its oracle; tests/unit/test_attention_extend.py) through torch's fused
scaled-dot-product attention: each request's cached prefix is dequantized once from its own pages
(attention_ref.gather_context) and its new tokens attend to it and causally to themselves, GQA inside the fused op.
Why: 16 single-request ShareGPT prefills through the engine (SmolLM2, 2-core CPU) took 4.8 s with the reference's
einsums, 2.6 s with this; bf16's torch_native 2.9 s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sgl_kvq.attention_ref import gather_context, plan_pages, read_base, visible_from, window_mask
from sgl_kvq.plan import LayerKV, PagedPlan


class StepReads:
    """The base pages one layer's page steps (KVQ_PREFILL=paged: sgl_kvq/metadata/forward.py) have read, per
    request, so step j dequantizes only the pages step j - 1 had not: a prompt of n pages reads n pages per layer
    instead of n(n - 1)/2. A packed page never changes once written, and every step's plan lists a request's base
    pages in order, the earlier steps' first. Why: 4 cold 1,024-token prompts on SmolLM2 took 3.9 s paged against
    2.7 s full (kivi4, 2-core CPU), and py-spy put a third of the difference in these repeated reads."""

    def __init__(self):
        self._owner: tuple[object, int] | None = None  # the forward plan (by identity) and layer the reads are of
        self._reads: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # b -> (pages, k, v)

    def contexts(self, forward_plan, layer: int, kv: LayerKV,
                 plan: PagedPlan) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each request's context in step plan `plan` of `forward_plan` at `layer` (gather_context's), its base
        pages read once per forward plan and layer."""
        if self._owner is None or self._owner[0] is not forward_plan or self._owner[1] != layer:
            self._owner, self._reads = (forward_plan, layer), {}
        out = []
        for b in range(plan.batch_size):
            pages = plan_pages(plan, b)
            pages_read, k, v = self._reads.get(b, (pages[:0], None, None))
            n = pages_read.numel()
            if n > pages.numel() or not torch.equal(pages[:n], pages_read):  # not an earlier step's prefix
                n, k, v = 0, None, None
            if pages.numel() > n:
                k_new, v_new = read_base(kv, pages[n:])
                k, v = (k_new, v_new) if k is None else (torch.cat([k, k_new]), torch.cat([v, v_new]))
                self._reads[b] = (pages, k, v)
            out.append(gather_context(kv, plan, b, base=None if k is None else (k, v)))  # None: no base page
        return out

    def clear(self) -> None:
        """Drop the reads (a layer's last step is done: they are not read again)."""
        self._owner, self._reads = None, {}


def extend(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, qo_indptr: torch.Tensor, kv: LayerKV,
           plan: PagedPlan, sm_scale: float,
           contexts: list[tuple[torch.Tensor, torch.Tensor]] | None = None, window: int = -1) -> torch.Tensor:
    """q [N, Hq, D], k_new/v_new [N, H, D]: request b's new tokens are rows qo_indptr[b]:qo_indptr[b+1] -> [N, Hq, Dv]
    in q's dtype, computed in fp32 as the reference is. The prefix is the plan's pages and frames, or contexts[b] (its
    K/V [T, H, D] from elsewhere, e.g. SpeCache's 16-bit host tier); a sliding `window` (attention_ref) hides what
    lies before it."""
    out = torch.empty(q.shape[0], q.shape[1], v_new.shape[-1], dtype=q.dtype, device=q.device)
    bounds = qo_indptr.tolist()
    for b in range(plan.batch_size):
        lo, hi = bounds[b], bounds[b + 1]
        if hi == lo:
            continue
        k, v = k_new[lo:hi].float(), v_new[lo:hi].float()
        kp, vp = gather_context(kv, plan, b) if contexts is None else (contexts[b][0].float(), contexts[b][1].float())
        n, p = hi - lo, kp.shape[0]
        mask = None  # no cached prefix and nothing out of the window: the fused causal path
        if p or 0 <= window < n - 1:
            # the prefix before the first query's window is never seen: not read into the attention at all
            first = int(visible_from(p, window))
            mask = window_mask(n, p, window, q.device)[:, first:]
            k, v = torch.cat([kp[first:], k]), torch.cat([vp[first:], v])
        # [1, heads, tokens, D]: torch's CPU flash kernel takes 4-d inputs only; 3-d ones run its unfused math path,
        # 1.5-3x slower (SmolLM2 heads, 270-480 tokens, fp32 and bf16, 2 threads).
        o = F.scaled_dot_product_attention(q[lo:hi].float().transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=mask, is_causal=mask is None,
                                           scale=sm_scale, enable_gqa=True)
        out[lo:hi] = o[0].transpose(0, 1)
    return out
