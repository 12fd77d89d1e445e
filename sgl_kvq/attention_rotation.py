"""KVQ_ROTATE: the kvq attention backends attend in a rotated basis along head_dim.

With R an orthogonal [D, D] matrix (rows are vectors, x_rot = x @ R), attention is unchanged by rotating q, k and v
alike and the output back: softmax((q R)(K R)^T) = softmax(q K^T), and P (V R) R^T = P V. What changes is what the
pool quantizes: K R and V R, whose channels a Hadamard R mixes, so one outlier channel no longer sets a whole
group's scale (offline on SmolLM2: KIVI-3 attention error 0.244 -> 0.215, kivi2 0.597 -> 0.514;
bench/results/attention_fidelity.md).

Where: the backends' forward_extend / forward_decode entry (sgl_kvq/backends/base.py), the one place every kvq
backend (kvq_torch, kvq_triton and their specache subclasses) goes through. K and V are rotated before they are
written, so everything downstream holds rotated rows and needs no change: the packed pages, the fp16 frames, the
radix tree's shared pages, SpeCache's 16-bit host tier, HiCache's and PD's bytes; every reader (the torch paths,
the C kernel, the Triton kernels) attends rotated q over them and the output is rotated back here.

Why not inside the kernels: at the boundary a step costs one [tokens, heads, D] x [D, D] product for each of q, k,
v and the output, each token once. A read-side fusion would rotate every K/V row each time a kernel reads it
(context length times more work); a write-side and q-load fusion would save the same four small products' memory
traffic only, a few microseconds per layer next to the attention itself. Folding R into v_proj and R^T into o_proj
would remove the V half entirely (V has no RoPE) but changes the weights, which the plugin does not touch.
"""

from __future__ import annotations

import torch

from sgl_kvq.quant.rotation import hadamard

ROTATIONS = ("none", "hadamard")


def basis(name: str, head_dim: int) -> torch.Tensor | None:
    """The [D, D] float32 orthogonal matrix of a KVQ_ROTATE value, None for "none"."""
    if name == "none":
        return None
    if name == "hadamard":
        return hadamard(head_dim)
    raise ValueError(f"unknown rotation {name!r}; choose one of {', '.join(ROTATIONS)}")


class HeadRotation:
    """x -> x @ R per head (`into`) and back with R^T (`back`), for rows [N, heads * D] or [..., D], in float32 and
    returned in x's dtype (a bf16 model rounds the rotated row once, as it rounds the row itself)."""

    def __init__(self, r: torch.Tensor):
        self.r = r.float().contiguous()
        self.r_t = self.r.T.contiguous()
        self.head_dim = r.shape[0]

    def _apply(self, x: torch.Tensor | None, m: torch.Tensor) -> torch.Tensor | None:
        if x is None:
            return None
        rows = x.reshape(-1, self.head_dim)
        return (rows.float() @ m).to(x.dtype).reshape(x.shape)

    def into(self, x: torch.Tensor | None) -> torch.Tensor | None:
        return self._apply(x, self.r)

    def back(self, x: torch.Tensor | None) -> torch.Tensor | None:
        return self._apply(x, self.r_t)


def for_config(cfg, head_dim: int, device) -> HeadRotation | None:
    """The rotation a pool's config asks for, on the pool's device, or None."""
    r = basis(cfg.rotate, head_dim)
    return None if r is None else HeadRotation(r.to(device))
