"""SpeCache's 16-bit cached prefix staged as fp16 frames, so kvq_triton's fused extend reads it.

An extend with KVQ_SPECACHE_PREFIX=host (the default) attends to its cached prefix in 16 bits, read back from the
host tier. kvq_triton's extend kernel (kernels/extend_attention.py) reads a request's context as packed base pages
followed by model-dtype frames [F, G, H, D]; a plan with no base pages whose frames hold the prefix rows makes it
read exactly those rows, in position order. Per layer the rows cross from the host tier into the staging frames
once (on a GPU: the PCIe traffic docs/results.md's "What SpeCache's 16-bit extends cost" counts), and the attention runs
in the kernel, not in torch.

    pf = build(prefix_slots, G, device)         # per batch: the frame plan, shared by every layer
    ov_k, ov_v = stage(pf, host_tier, layer)     # per layer: the rows in their frames
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from sgl_kvq.plan import PagedPlan


@dataclass
class PrefixFrames:
    plan: PagedPlan  # request b's context: its prefix as frames ov_indices[ov_indptr[b]:ov_indptr[b + 1]]
    slots: torch.Tensor  # [N] int64 pool slots of every request's prefix, request after request
    rows: torch.Tensor  # [N] int64 where each lands in the staging frames viewed as [F * G, H, D]
    num_frames: int
    page_size: int


def build(prefix_slots: list[torch.Tensor], page_size: int, device: torch.device) -> PrefixFrames:
    """prefix_slots[b]: request b's cached prefix as pool slots, in position order (empty: no prefix)."""
    G = page_size
    lens = [int(s.numel()) for s in prefix_slots]
    frames = [-(-n // G) for n in lens]
    ends = list(itertools.accumulate(frames))
    starts = [e - f for e, f in zip(ends, frames)]
    total = ends[-1] if ends else 0
    i32 = dict(dtype=torch.int32, device=device)
    plan = PagedPlan(
        kv_indptr=torch.zeros(len(lens) + 1, **i32),
        kv_indices=torch.zeros(0, **i32),
        kv_last_page_len=torch.zeros(len(lens), **i32),
        ov_indptr=torch.tensor([0] + ends, **i32),
        ov_indices=torch.arange(total, **i32),
        ov_last_page_len=torch.tensor([n - (f - 1) * G if f else 0 for n, f in zip(lens, frames)], **i32),
    )
    rows = [torch.arange(n, dtype=torch.int64) + s * G for n, s in zip(lens, starts)]
    return PrefixFrames(plan=plan, slots=torch.cat([s.long() for s in prefix_slots]).to(device),
                        rows=torch.cat(rows).to(device), num_frames=total, page_size=G)


def stage(pf: PrefixFrames, host, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefix rows of layer `layer` from host tier `host` (specache/host_tier.py) in their frames: (ov_k, ov_v)
    [max(F, 1), G, H, D] in the host tier's dtype; rows past a request's prefix in its last frame are zero (the
    kernel does not read them)."""
    k, v = host.rows(layer, pf.slots)
    H, D = host.hk.shape[2], host.hk.shape[3]
    out_k = torch.zeros(max(pf.num_frames, 1) * pf.page_size, H, D, dtype=host.hk.dtype, device=k.device)
    out_v = torch.zeros_like(out_k)
    out_k[pf.rows] = k
    out_v[pf.rows] = v
    return out_k.view(-1, pf.page_size, H, D), out_v.view(-1, pf.page_size, H, D)
