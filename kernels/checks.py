"""Launcher-side checks of one layer's pool view against sgl_kvq/layout.py (layer dim removed):

    k_codes, v_codes  [S, H, Dp]        uint8, Dp = D * bits // 8, S = P * G
    k_scale, k_zero   [P, H, D]         fp16
    v_scale, v_zero   [S, H, D // VG]   fp16
    ov_k, ov_v        [F, G, H, D]      model dtype
Kernels index dims 0 and 1 through strides and assume the last dim is contiguous. GEAR's correction buffers
(kv.corr: k_u, v_u [P, H, r, G]; k_w, v_w [P, H, r, D]; k_out_* [P, H, NK, D]; v_out_* [S, H, NV]) are indexed by
their contiguous shape (correction_args), and so are LogQuant's rows (kv.rows: k_rows, v_rows [P, M, H, D] fp16,
row_off [P, M] uint8; rows_args) and zipcache2's salient planes (kv.sal: v_chan, s_k_scale, s_k_zero [P, H, D];
s_idx [P, H, NS]; s_k_codes, s_v_codes [P, H, NS, D // 2]; s_v_scale, s_v_zero [P, H, NS, D // VG]; salient_args).
"""

from __future__ import annotations

import os

import torch

from sgl_kvq.plan import LayerKV, PagedPlan
from sgl_kvq.quant.pack import packed_dim
from sgl_kvq.quant.uniform import SCALE_DTYPE

MODEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Whether the attention kernels multiply in fp32: for fp32 data, and for bf16 under the Triton interpreter,
    where bf16 tl.dot returns garbage (fp16 and fp32 are exact there)."""
    return dtype == torch.float32 or (interpreting() and dtype == torch.bfloat16)


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"sgl_kvq kernels: {msg}")


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_layer(kv: LayerKV) -> tuple[int, int, int, int]:
    """Returns (H, D, G, VG) after checking every buffer of the layer view."""
    F, G, H, D = kv.ov_k.shape
    require(kv.bits in (1, 2, 4), f"bits must be 1, 2 or 4, got {kv.bits}")
    require(is_pow2(D) and D >= 16, f"head_dim {D} must be a power of two >= 16")
    require(is_pow2(G) and G >= 16, f"page size G={G} must be a power of two >= 16 (tl.dot tiles)")
    S, Dp = kv.k_codes.shape[0], packed_dim(D, kv.bits)
    require(S % G == 0, f"k_codes has {S} slots, not a multiple of G={G}")
    P = S // G
    NG = kv.v_scale.shape[-1]
    require(NG > 0 and D % NG == 0 and is_pow2(D // NG), f"v_scale last dim {NG} does not divide head_dim {D}")
    want = {
        "k_codes": ((S, H, Dp), torch.uint8), "v_codes": ((S, H, Dp), torch.uint8),
        "k_scale": ((P, H, D), SCALE_DTYPE), "k_zero": ((P, H, D), SCALE_DTYPE),
        "v_scale": ((S, H, NG), SCALE_DTYPE), "v_zero": ((S, H, NG), SCALE_DTYPE),
        "ov_v": ((F, G, H, D), kv.ov_k.dtype),
    }
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
    require(kv.k_codes.stride() == kv.v_codes.stride(), "k_codes and v_codes strides differ")
    require(kv.ov_k.stride() == kv.ov_v.stride(), "ov_k and ov_v strides differ")
    return H, D, G, D // NG


def correction_args(kv: LayerKV) -> tuple[tuple[torch.Tensor, ...], dict[str, int]]:
    """The kernels' correction pointers (KU, KW, VU, VW, KOV, KOI, VOV, VOI) and constexprs (RANK, NK, NV) after
    checking kv.corr against the layout; for a format without one, RANK = 0 and the pointers are never read."""
    c = kv.corr
    if c is None:
        return (kv.k_scale,) * 8, dict(RANK=0, NK=0, NV=0)
    S, H, _ = kv.k_codes.shape
    F, G, _, D = kv.ov_k.shape
    P, r, NK, NV = S // G, c.k_u.shape[2], c.k_out_val.shape[2], c.v_out_val.shape[-1]
    require(r >= 1, "a GEAR correction needs rank >= 1")
    want = {
        "k_u": ((P, H, r, G), SCALE_DTYPE), "k_w": ((P, H, r, D), SCALE_DTYPE),
        "v_u": ((P, H, r, G), SCALE_DTYPE), "v_w": ((P, H, r, D), SCALE_DTYPE),
        "k_out_val": ((P, H, NK, D), SCALE_DTYPE), "k_out_idx": ((P, H, NK, D), torch.uint8),
        "v_out_val": ((S, H, NV), SCALE_DTYPE), "v_out_idx": ((S, H, NV), torch.uint8),
    }
    for name, (shape, dtype) in want.items():
        t = getattr(c, name)
        require(tuple(t.shape) == shape and t.dtype == dtype,
                f"corr.{name}: got {tuple(t.shape)} {t.dtype}, layout says {shape} {dtype}")
        require(t.is_contiguous() and t.device == kv.ov_k.device, f"corr.{name} must be contiguous on the pool's device")
    tensors = tuple(getattr(c, n) if getattr(c, n).numel() else kv.k_scale for n in want)  # no null pointers
    return tensors, dict(RANK=r, NK=NK, NV=NV)


def rows_args(kv: LayerKV) -> tuple[tuple[torch.Tensor, ...], dict[str, int]]:
    """The kernels' LogQuant row pointers (KR, VR, RO) and constexpr NROWS after checking kv.rows against the
    layout; for a format without rows, NROWS = 0 and the pointers are never read."""
    r = kv.rows
    if r is None:
        return (kv.k_scale,) * 3, dict(NROWS=0)
    S, H, _ = kv.k_codes.shape
    F, G, _, D = kv.ov_k.shape
    P, M = S // G, r.row_off.shape[-1]
    require(M >= 1 and G <= 128, f"LogQuant rows need M >= 1 slots and G <= 128 (255 marks empty), got {M}, {G}")
    want = {"k_rows": ((P, M, H, D), SCALE_DTYPE), "v_rows": ((P, M, H, D), SCALE_DTYPE),
            "row_off": ((P, M), torch.uint8)}
    for name, (shape, dtype) in want.items():
        t = getattr(r, name)
        require(tuple(t.shape) == shape and t.dtype == dtype,
                f"rows.{name}: got {tuple(t.shape)} {t.dtype}, layout says {shape} {dtype}")
        require(t.is_contiguous() and t.device == kv.ov_k.device,
                f"rows.{name} must be contiguous on the pool's device")
    return (r.k_rows, r.v_rows, r.row_off), dict(NROWS=M)


def salient_args(kv: LayerKV) -> tuple[tuple[torch.Tensor, ...], dict[str, int]]:
    """The kernels' salient-plane pointers (VCH, SI, SKC, SKS, SKZ, SVC, SVS, SVZ) and constexpr NSAL after checking
    kv.sal against the layout; for a format without one, NSAL = 0 and the pointers are never read."""
    s = kv.sal
    if s is None:
        return (kv.k_scale,) * 8, dict(NSAL=0)
    S, H, _ = kv.k_codes.shape
    F, G, _, D = kv.ov_k.shape
    P, NS, NG = S // G, s.s_idx.shape[-1], kv.v_scale.shape[-1]
    require(1 <= NS < G, f"zipcache2 needs 1..G-1 salient tokens per page, got {NS}")
    want = {
        "v_chan": ((P, H, D), SCALE_DTYPE), "s_idx": ((P, H, NS), torch.uint8),
        "s_k_codes": ((P, H, NS, packed_dim(D, 4)), torch.uint8),
        "s_k_scale": ((P, H, D), SCALE_DTYPE), "s_k_zero": ((P, H, D), SCALE_DTYPE),
        "s_v_codes": ((P, H, NS, packed_dim(D, 4)), torch.uint8),
        "s_v_scale": ((P, H, NS, NG), SCALE_DTYPE), "s_v_zero": ((P, H, NS, NG), SCALE_DTYPE),
    }
    for name, (shape, dtype) in want.items():
        t = getattr(s, name)
        require(tuple(t.shape) == shape and t.dtype == dtype,
                f"sal.{name}: got {tuple(t.shape)} {t.dtype}, layout says {shape} {dtype}")
        require(t.is_contiguous() and t.device == kv.ov_k.device, f"sal.{name} must be contiguous on the pool's device")
    return tuple(getattr(s, n) for n in want), dict(NSAL=NS)


def check_paged(p: PagedPlan, device: torch.device) -> None:
    B = p.batch_size
    for name in ("kv_indptr", "kv_indices", "kv_last_page_len", "ov_indptr", "ov_indices", "ov_last_page_len"):
        t = getattr(p, name)
        require(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
        require(t.device == device, f"{name} is on {t.device}, the pool on {device}")
        require(t.dim() == 1 and t.is_contiguous(), f"{name} must be a contiguous 1-D tensor")
    require(p.ov_indptr.numel() == B + 1, "ov_indptr and kv_indptr disagree on the batch size")
    require(p.kv_last_page_len.numel() == B and p.ov_last_page_len.numel() == B, "last_page_len must be [B]")
