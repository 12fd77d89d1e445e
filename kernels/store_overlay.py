"""Scatter single-token K/V rows into the fp16 overlay frames (the open page and the recent window)."""

from __future__ import annotations

import torch
import triton

from sgl_kvq.plan import LayerKV

from .checks import MODEL_DTYPES, check_layer, check_rotation, require
from .store_overlay_kernel import _store_overlay_kernel


def store_overlay(k: torch.Tensor, v: torch.Tensor, frames: torch.Tensor, offsets: torch.Tensor, kv: LayerKV,
                  v_rotation: torch.Tensor | None = None) -> None:
    """ov_k[frames[t], offsets[t]] = k[t] (and v likewise) for t < T; k, v [T, H, D], frames/offsets [T] ints.
    Rows are cast to the overlay's dtype. v_rotation: R [D, D] fp32, and v[t] @ R is stored instead of v[t]
    (KVQ_ROTATE=values, sgl_kvq/attention_rotation.py), computed in fp32 and rounded once."""
    H, D, G, _ = check_layer(kv)
    require(k.dim() == 3 and tuple(k.shape[1:]) == (H, D) and v.shape == k.shape,
            f"k, v must be [T, H={H}, D={D}], got {tuple(k.shape)} {tuple(v.shape)}")
    require(k.dtype in MODEL_DTYPES and v.dtype in MODEL_DTYPES, f"k/v dtype {k.dtype}/{v.dtype}")
    require(k.stride(-1) == 1 and v.stride(-1) == 1, "k and v must be contiguous in their last dim")
    T = k.shape[0]
    for name, t in (("frames", frames), ("offsets", offsets)):
        require(t.shape == (T,) and t.device == k.device and not t.is_floating_point(),
                f"{name} must be [T={T}] integers on {k.device}")
    require(k.device == kv.ov_k.device and v.device == k.device, "k/v and the pool are on different devices")
    rotate = v_rotation is not None
    if rotate:
        check_rotation(v_rotation, D, k.device)
    if T == 0:
        return
    _store_overlay_kernel[(T,)](
        k, v, frames, offsets, kv.ov_k, kv.ov_v, v_rotation if rotate else kv.ov_v,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv.ov_k.stride(0), kv.ov_v.stride(0), kv.ov_k.stride(1), kv.ov_k.stride(2),
        H=H, D=D, BLOCK_H=max(16 if rotate else 1, triton.next_power_of_2(H)), ROTATE_V=rotate,
    )
