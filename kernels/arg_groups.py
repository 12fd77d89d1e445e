"""The argument groups the attention kernels take as Triton tuple arguments, built by their launchers. Named tuples:
the jitted code reads a field by its name (POOL.k_codes), and a group travels through the jitted helpers as one
parameter. The format's page tensors are a group too (format_extras.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl_kvq.plan import LayerKV, PagedPlan


class PoolArgs(NamedTuple):
    """One layer's packed base pages and fp16 overlay frames (checks.check_layer: scale and zero share strides; key
    and value codes may differ in width, each has its own) with the strides the kernels index them by; every last
    dim is contiguous."""
    k_codes: torch.Tensor
    k_scale: torch.Tensor
    k_zero: torch.Tensor
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    v_zero: torch.Tensor
    ov_k: torch.Tensor
    ov_v: torch.Tensor
    stride_kc_slot: int
    stride_kc_head: int
    stride_vc_slot: int
    stride_vc_head: int
    stride_ks_page: int
    stride_ks_head: int
    stride_vs_slot: int
    stride_vs_head: int
    stride_ov_frame: int
    stride_ovv_frame: int  # ov_v's: pooled frames over a recipe layer's narrower value codes lie closer together
    stride_ov_tok: int
    stride_ov_head: int


def pool_args(kv: LayerKV) -> PoolArgs:
    return PoolArgs(kv.k_codes, kv.k_scale, kv.k_zero, kv.v_codes, kv.v_scale, kv.v_zero, kv.ov_k, kv.ov_v,
                    kv.k_codes.stride(0), kv.k_codes.stride(1), kv.v_codes.stride(0), kv.v_codes.stride(1),
                    kv.k_scale.stride(0), kv.k_scale.stride(1),
                    kv.v_scale.stride(0), kv.v_scale.stride(1), kv.ov_k.stride(0), kv.ov_v.stride(0),
                    kv.ov_k.stride(1), kv.ov_k.stride(2))


class PageLists(NamedTuple):
    """PagedPlan's lists (checks.check_paged): each request's base pages, then its overlay frames."""
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    ov_indptr: torch.Tensor
    ov_indices: torch.Tensor
    ov_last_page_len: torch.Tensor


def page_lists(p: PagedPlan) -> PageLists:
    return PageLists(p.kv_indptr, p.kv_indices, p.kv_last_page_len, p.ov_indptr, p.ov_indices, p.ov_last_page_len)


class SplitParts(NamedTuple):
    """Split-KV partial outputs, o [rows, Hq, splits, D] and lse [rows, Hq, splits] fp32, which merge_state
    combines."""
    o: torch.Tensor
    lse: torch.Tensor
    stride_ob: int
    stride_oh: int
    stride_os: int
    stride_lb: int
    stride_lh: int


def split_parts(o_partial: torch.Tensor, lse_partial: torch.Tensor) -> SplitParts:
    return SplitParts(o_partial, lse_partial, o_partial.stride(0), o_partial.stride(1), o_partial.stride(2),
                      lse_partial.stride(0), lse_partial.stride(1))
