"""KVQ_ROTATE: the kvq attention backends store V (and with "hadamard" also q and K) in a rotated basis along
head_dim.

With R an orthogonal [D, D] matrix (rows are vectors, x_rot = x @ R), attention is unchanged by rotating q, k and v
alike and the output back: softmax((q R)(K R)^T) = softmax(q K^T), and P (V R) R^T = P V. The scores need only q and
K in one basis, so V alone may be rotated: P (V R) R^T = P V with q and K as the model computes them. What changes
is what the pool quantizes: the rows of V R (and K R), whose channels a Hadamard R mixes, so one outlier channel no
longer sets a whole per-token group's scale.

"values" (V alone) is the better of the two on every KIVI width and both models, offline (attention error, SmolLM2
kivi4 0.108 -> 0.095, kivi3 0.233 -> 0.204, kivi2 0.587 -> 0.500; Gemma 3 kivi4 0.098 -> 0.089, where rotating q and
K too gives 0.138; bench/results/attention_fidelity_rotation.md), and costs two [tokens, heads, D] x [D, D]
products per layer instead of four. Which dtypes rotate by default: sgl_kvq/formats/rotation.py.

R is block_hadamard(D): the normalized Hadamard matrix of D's largest power-of-two factor along the diagonal (H_D
itself for the power-of-two head_dims of every model measured), defined for every head_dim the pool packs.

Where: the backends' forward_extend / forward_decode entry (sgl_kvq/backends/base.py), the one place every kvq
backend (kvq_torch, kvq_triton and their specache subclasses) goes through. Rows are rotated before they are written,
so everything downstream holds rotated rows and needs no change: the packed pages, the fp16 frames, the radix tree's
shared pages, SpeCache's 16-bit host tier, HiCache's and PD's bytes; every reader (the torch paths, the C kernel,
the Triton kernels) attends over them and the output is rotated back here. A backend whose kernels apply the values
rotation themselves (Triton decode: V rotated as the overlay write stores it, the output as the split merge writes
it; `fused_decode_rotation`) skips the products here for decode.
"""

from __future__ import annotations

import torch

from sgl_kvq.quant.rotation import block_hadamard

# "none": as the model computes them; "values": V alone; "hadamard": q, K and V alike
ROTATIONS = ("none", "values", "hadamard")


def basis(name: str, head_dim: int) -> torch.Tensor | None:
    """The [D, D] float32 orthogonal matrix of a KVQ_ROTATE value, None for "none"."""
    if name == "none":
        return None
    if name in ("values", "hadamard"):
        return block_hadamard(head_dim)
    raise ValueError(f"unknown rotation {name!r}; choose one of {', '.join(ROTATIONS)}")


class HeadRotation:
    """x -> x @ R per head (`into`) and back with R^T (`back`), for rows [N, heads * D] or [..., D], in float32 and
    returned in x's dtype (a bf16 model rounds the rotated row once, as it rounds the row itself). `keys`: whether q
    and K are rotated too ("hadamard") or V alone ("values")."""

    def __init__(self, r: torch.Tensor, keys: bool = True):
        self.r = r.float().contiguous()
        self.r_t = self.r.T.contiguous()
        self.head_dim = r.shape[0]
        self.keys = keys

    def _apply(self, x: torch.Tensor | None, m: torch.Tensor) -> torch.Tensor | None:
        if x is None:
            return None
        rows = x.reshape(-1, self.head_dim)
        return (rows.float() @ m).to(x.dtype).reshape(x.shape)

    def into(self, x: torch.Tensor | None) -> torch.Tensor | None:
        return self._apply(x, self.r)

    def back(self, x: torch.Tensor | None) -> torch.Tensor | None:
        return self._apply(x, self.r_t)

    def inputs(self, q, k, v):
        """A layer's q, k, v in the stored basis."""
        return (self.into(q), self.into(k), self.into(v)) if self.keys else (q, k, self.into(v))


def for_config(cfg, head_dim: int, device) -> HeadRotation | None:
    """The rotation a pool's config asks for, on the pool's device, or None."""
    r = basis(cfg.rotate, head_dim)
    return None if r is None else HeadRotation(r.to(device), keys=cfg.rotate == "hadamard")
