"""SpeCache's host-tier row copies: scatter a batch's 16-bit K/V rows into the host tier (the write path) and
gather single-head rows out of it (the top-k prefetch). Torch references: sgl_kvq/specache/host_tier.py's
scatter_rows_ref / gather_head_rows_ref (plain index ops, which the CPU path uses);
tests/unit/test_specache_host_tier.py compares the two.

Host tier layout (one layer): hk, hv [S, H, D] 16-bit, indexed by pool token slot (sgl_kvq/specache/host_tier.py).
On CUDA hk/hv are pinned host tensors, passed to the kernels by address (UVA): `_HostPtr` carries the pointer so
Triton does not reject a CPU tensor.
"""

from __future__ import annotations

import torch
import triton

from .checks import MODEL_DTYPES, require
from .host_rows_kernel import _gather_head_rows_kernel, _scatter_rows_kernel


class _HostPtr:
    """A pinned host tensor seen by a CUDA kernel: same address under unified virtual addressing."""

    def __init__(self, t: torch.Tensor):
        self.t, self.dtype = t, t.dtype

    def data_ptr(self) -> int:
        return self.t.data_ptr()


def _arg(host: torch.Tensor, device: torch.device):
    if device.type == "cuda" and host.device.type == "cpu":
        require(host.is_pinned(), "a host tier read from CUDA must be pinned memory")
        return _HostPtr(host)
    require(host.device == device, f"host tier on {host.device}, rows on {device}")
    return host


def _check_tier(hk: torch.Tensor, hv: torch.Tensor) -> tuple[int, int]:
    require(hk.dim() == 3 and hk.shape == hv.shape and hk.stride() == hv.stride(), "hk, hv must be [S, H, D] alike")
    require(hk.dtype in MODEL_DTYPES and hv.dtype == hk.dtype and hk.stride(-1) == 1, f"host dtype {hk.dtype}")
    return hk.shape[1], hk.shape[2]


def scatter_rows(k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, hk: torch.Tensor, hv: torch.Tensor) -> None:
    """hk[slots[t]] = k[t], hv[slots[t]] = v[t]; k, v [T, H, D] on the compute device, slots [T] ints there."""
    H, D = _check_tier(hk, hv)
    require(k.dim() == 3 and tuple(k.shape[1:]) == (H, D) and v.shape == k.shape, f"k, v must be [T, {H}, {D}]")
    require(k.stride(-1) == 1 and v.stride(-1) == 1, "k, v must be contiguous in their last dim")
    T = k.shape[0]
    require(slots.shape == (T,) and slots.device == k.device and not slots.is_floating_point(), "slots must be [T]")
    if T == 0:
        return
    _scatter_rows_kernel[(T,)](
        k, v, slots, _arg(hk, k.device), _arg(hv, k.device),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), hk.stride(0), hk.stride(1),
        H=H, D=D, BLOCK_H=triton.next_power_of_2(H),
    )


def gather_head_rows(hk: torch.Tensor, hv: torch.Tensor, slots: torch.Tensor, heads: torch.Tensor,
                     out_k: torch.Tensor, out_v: torch.Tensor, out_rows: torch.Tensor | None = None) -> None:
    """out_k[out_rows[n]] = hk[slots[n], heads[n]] (and out_v from hv) for n < N; slots < 0 give zero rows.
    out_k, out_v [M, D]; out_rows [N] (default: 0 .. N - 1, M = N)."""
    H, D = _check_tier(hk, hv)
    N = slots.numel()
    dev = out_k.device
    if out_rows is None:
        require(out_k.shape[0] == N, f"{out_k.shape[0]} output rows for {N} copies (pass out_rows)")
        out_rows = torch.arange(N, device=dev)
    require(slots.shape == (N,) and heads.shape == (N,) and out_rows.shape == (N,), "slots, heads, out_rows: [N]")
    require(slots.device == dev and heads.device == dev and out_rows.device == dev,
            "index tensors off the output's device")
    require(out_k.dim() == 2 and out_k.shape[1] == D and out_v.shape == out_k.shape
            and out_k.stride() == out_v.stride(), f"out_k, out_v must be [M, D={D}] alike")
    require(out_k.stride(-1) == 1 and triton.next_power_of_2(D) == D, "rows must be contiguous, D a power of two")
    if N == 0:
        return
    _gather_head_rows_kernel[(N,)](
        _arg(hk, dev), _arg(hv, dev), slots, heads, out_rows, out_k, out_v, hk.stride(0), hk.stride(1),
        out_k.stride(0), D=D,
    )
