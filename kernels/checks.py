"""Launcher-side checks of one layer's pool view against sgl_kvq/layout.py (layer dim removed): KIVI's base
tensors as layout.kivi_shapes declares them (k_codes, v_codes [S, H, Dp] uint8; k_scale, k_zero [P, H, D] and
v_scale, v_zero [S, H, D // VG] fp16) and the overlay frames ov_k, ov_v [F, G, H, D] in the model dtype. Kernels index
their dims 0 and 1 through strides and assume the last dim is contiguous. A format's extras are checked by
format_extras.py against the shapes the format declares (sgl_kvq/formats/).
"""

from __future__ import annotations

import os

import torch

from sgl_kvq.errors import LayoutError
from sgl_kvq.layout import PageGeometry, kivi_shapes
from sgl_kvq.plan import LayerKV, PagedPlan

MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether the attention kernels multiply in fp32: for fp32 data, and for bf16 under the Triton interpreter,
    where bf16 tl.dot returns garbage (fp16 and fp32 are exact there)."""
    return dtype == torch.float32 or (interpreting() and dtype == torch.bfloat16)


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise LayoutError(f"sgl_kvq kernels: {msg}")


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def layer_geometry(kv: LayerKV) -> PageGeometry:
    F, G, H, D = kv.ov_k.shape
    return PageGeometry(P=kv.k_codes.shape[0] // G, G=G, H=H, D=D, NG=kv.v_scale.shape[-1])


def check_layer(kv: LayerKV) -> tuple[int, int, int, int]:
    """Returns (H, D, G, VG) after checking every buffer of the layer view."""
    F, G, H, D = kv.ov_k.shape
    NG = kv.v_scale.shape[-1]
    for what, b in (("k_bits", kv.k_bits), ("v_bits", kv.v_bits)):
        require(b in (1, 2, 3, 4), f"{what} must be 1, 2, 3 or 4, got {b}")
    require(is_pow2(D) and D >= 16, f"head_dim {D} must be a power of two >= 16")
    require(is_pow2(G) and G >= 16, f"page size G={G} must be a power of two >= 16 (tl.dot tiles)")
    require(kv.k_codes.shape[0] % G == 0, f"k_codes has {kv.k_codes.shape[0]} slots, not a multiple of G={G}")
    require(NG > 0 and D % NG == 0 and is_pow2(D // NG), f"v_scale last dim {NG} does not divide head_dim {D}")
    want = {**kivi_shapes(layer_geometry(kv), kv.k_bits, kv.v_bits), "ov_v": (tuple(kv.ov_k.shape), kv.ov_k.dtype)}
    require(kv.ov_k.dtype in MODEL_DTYPES, f"ov_k dtype {kv.ov_k.dtype} is not a model dtype")
    for name, (shape, dtype) in want.items():
        t = getattr(kv, name)
        require(tuple(t.shape) == shape and t.dtype == dtype,
                f"{name}: got {tuple(t.shape)} {t.dtype}, layout says {shape} {dtype}")
    for name in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero", "ov_k", "ov_v"):
        t = getattr(kv, name)
        require(t.device == kv.ov_k.device, f"{name} is on {t.device}, ov_k on {kv.ov_k.device}")
        require(t.stride(-1) == 1, f"{name} must be contiguous in its last dim")
    require(kv.k_scale.stride() == kv.k_zero.stride(), "k_scale and k_zero strides differ")
    require(kv.v_scale.stride() == kv.v_zero.stride(), "v_scale and v_zero strides differ")
    # frames may lie apart by different strides (pooled over a recipe layer's key and value codes); within a frame
    # they agree
    require(kv.ov_k.stride()[1:] == kv.ov_v.stride()[1:], "ov_k and ov_v strides within a frame differ")
    return H, D, G, D // NG


def check_rotation(r: torch.Tensor, head_dim: int, device: torch.device) -> None:
    """A rotation the kernels apply (KVQ_ROTATE=values): [D, D] fp32, contiguous, on the data's device."""
    require(tuple(r.shape) == (head_dim, head_dim) and r.dtype == torch.float32 and r.is_contiguous(),
            f"a rotation must be a contiguous [{head_dim}, {head_dim}] fp32 matrix, got {tuple(r.shape)} {r.dtype}")
    require(r.device == device, f"the rotation is on {r.device}, the data on {device}")


def check_paged(p: PagedPlan, device: torch.device) -> None:
    B = p.batch_size
    for name in ("kv_indptr", "kv_indices", "kv_last_page_len", "ov_indptr", "ov_indices", "ov_last_page_len"):
        t = getattr(p, name)
        require(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
        require(t.device == device, f"{name} is on {t.device}, the pool on {device}")
        require(t.dim() == 1 and t.is_contiguous(), f"{name} must be a contiguous 1-D tensor")
    require(p.ov_indptr.numel() == B + 1, "ov_indptr and kv_indptr disagree on the batch size")
    require(p.kv_last_page_len.numel() == B and p.ov_last_page_len.numel() == B, "last_page_len must be [B]")
