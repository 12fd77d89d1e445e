"""Quantize complete pages and write them into the packed base: the kernel twin of kivi_page.pack_pages."""

from __future__ import annotations

import torch

from sgl_kvq.plan import LayerKV

from .checks import MODEL_DTYPES, check_layer, require
from .quantize_pages_kernel import _quantize_pages_kernel


def quantize_pages(k: torch.Tensor, v: torch.Tensor, dst_pages: torch.Tensor, kv: LayerKV, *,
                   src_ids: torch.Tensor | None = None, specache_one_bit: bool = True) -> None:
    """Write k_codes/k_scale/k_zero/v_codes/v_scale/v_zero of pool pages `dst_pages` [N] from fp K/V.

    k, v: [N, G, H, D] (page n is k[n]) or, with src_ids [N], the overlay frames [F, G, H, D] holding them
    (page n is k[src_ids[n]]). fp16/bf16/fp32. Bit-exact with kivi_page.pack_pages on the same data.
    Destination page 0 (SGLang's dummy page) is skipped: a decode batch passes it for rows that complete no page."""
    H, D, G, VG = check_layer(kv)
    require(k.dim() == 4 and k.shape == v.shape and tuple(k.shape[1:]) == (G, H, D),
            f"k, v must be [N, G={G}, H={H}, D={D}], got {tuple(k.shape)} {tuple(v.shape)}")
    require(k.dtype in MODEL_DTYPES and v.dtype == k.dtype, f"k/v dtype {k.dtype}/{v.dtype}")
    # pooled frames over a recipe layer's key and value codes lie apart by different strides; within a page they agree
    require(k.stride()[1:] == v.stride()[1:] and k.stride(-1) == 1,
            "k and v must share strides within a page, last dim contiguous")
    require(k.device == kv.k_codes.device and v.device == k.device, "k/v and the pool are on different devices")
    require(dst_pages.dim() == 1 and dst_pages.device == k.device, "dst_pages must be a 1-D tensor on k's device")
    require(not dst_pages.is_floating_point(), "dst_pages must be integer page ids")
    n = dst_pages.numel()
    if src_ids is None:
        require(k.shape[0] == n, f"{k.shape[0]} pages of K/V for {n} destination pages")
        src_ids = torch.arange(n, device=k.device, dtype=torch.int32)
    require(src_ids.shape == dst_pages.shape and src_ids.device == k.device, "src_ids must match dst_pages")
    if n == 0:
        return
    _quantize_pages_kernel[(n, H)](
        k, v, src_ids, dst_pages,
        kv.k_codes, kv.k_scale, kv.k_zero, kv.v_codes, kv.v_scale, kv.v_zero,
        k.stride(0), v.stride(0), k.stride(1), k.stride(2),
        kv.k_codes.stride(0), kv.k_codes.stride(1), kv.v_codes.stride(0), kv.v_codes.stride(1),
        kv.k_scale.stride(0), kv.k_scale.stride(1), kv.v_scale.stride(0), kv.v_scale.stride(1),
        G=G, D=D, VG=VG, KBITS=kv.k_bits, VBITS=kv.v_bits, SPECACHE_ONE_BIT=specache_one_bit,
        # bit-exactness: no fma contraction of 3 * lo + hi or of the encode arithmetic
        enable_fp_fusion=False,
    )
