"""Merge split-KV partial attention states (o, lse) into the final output."""

from __future__ import annotations

import torch
import triton

from .checks import MODEL_DTYPES, check_rotation, require
from .merge_state_kernel import _merge_state_kernel

# Output channels the rotated merge computes at once: a [D, 32] tile of RT per step keeps a D = 128 program's tile
# at 4K fp32 values instead of 16K.
_ROTATE_COLUMNS = 32


def merge_state(o_partial: torch.Tensor, lse_partial: torch.Tensor, num_splits: torch.Tensor,
                out: torch.Tensor | None = None, lse_out: torch.Tensor | None = None,
                out_dtype: torch.dtype = torch.float32, out_rotation: torch.Tensor | None = None) -> torch.Tensor:
    """o_partial [B, H, S, D] fp32 (each split normalized over its own keys), lse_partial [B, H, S] fp32 natural-log
    sum-exp of each split's scores, num_splits [B] int32 (splits >= num_splits[b] are ignored, never read).
    Writes out [B, H, D] (out_dtype when allocated here) and, if given, lse_out [B, H] fp32; returns out.
    out_rotation: RT [D, D] fp32, and each merged row o is written as o @ RT (in fp32, rounded once)."""
    require(o_partial.dim() == 4 and o_partial.dtype == torch.float32, "o_partial must be [B, H, S, D] fp32")
    B, H, S, D = o_partial.shape
    require(tuple(lse_partial.shape) == (B, H, S) and lse_partial.dtype == torch.float32,
            "lse_partial must be [B, H, S] fp32")
    require(lse_partial.stride(-1) == 1 and o_partial.stride(-1) == 1, "partials must be contiguous in the last dim")
    require(num_splits.shape == (B,) and num_splits.dtype == torch.int32, "num_splits must be [B] int32")
    require(triton.next_power_of_2(D) == D, f"head_dim {D} must be a power of two")
    dev = o_partial.device
    require(lse_partial.device == dev and num_splits.device == dev, "partials and num_splits on different devices")
    if out is None:
        out = torch.empty(B, H, D, dtype=out_dtype, device=dev)
    require(tuple(out.shape) == (B, H, D) and out.dtype in MODEL_DTYPES and out.device == dev,
            f"out must be [B, H, D] of a model dtype on {dev}")
    require(out.stride(-1) == 1, "out must be contiguous in its last dim")
    if lse_out is not None:
        require(tuple(lse_out.shape) == (B, H) and lse_out.dtype == torch.float32 and lse_out.device == dev,
                "lse_out must be [B, H] fp32")
    rotate = out_rotation is not None
    if rotate:
        check_rotation(out_rotation, D, dev)
    if B == 0:
        return out
    lse_arg = lse_out if lse_out is not None else lse_partial
    _merge_state_kernel[(B, H)](
        o_partial, lse_partial, num_splits, out, lse_arg, out_rotation if rotate else o_partial,
        o_partial.stride(0), o_partial.stride(1), o_partial.stride(2), lse_partial.stride(0), lse_partial.stride(1),
        out.stride(0), out.stride(1), lse_arg.stride(0), lse_arg.stride(1),
        D=D, BLOCK_S=triton.next_power_of_2(S), WRITE_LSE=lse_out is not None, ROTATE=rotate,
        BLOCK_J=min(D, _ROTATE_COLUMNS),
    )
    return out
