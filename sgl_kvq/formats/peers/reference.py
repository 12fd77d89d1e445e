"""Pure-torch references of the KV formats the engines ship, for the offline attention-fidelity eval.

Every function takes k, v [T, H, D] (post-RoPE, fp32) and returns a CompressedKV whose `stored` holds the tensors at
the engine's real layout (names "k.*" / "v.*", counted by bench.quant.accounting) and whose k_hat / v_hat are
rebuilt from them. None of these formats keeps an fp16 window: every token is quantized, so `kept` is all False and
bytes per token do not depend on T. Bits per element below are at D = 64 (SmolLM2); per token, multiply the K+V bits
by 2 * H * D * layers / 8 (SmolLM2: 3 KV heads x 64 x 30 layers, so bytes/token = 1440 x bits).

    format            source followed                                  K bits  V bits  stored per (token, KV head)
    fp8_e4m3          SGLang --kv-cache-dtype fp8_e4m3                   8       8       D fp8 bytes each
    fp4_mx_block16    SGLang FP4MXBlock16KVQuantizeUtil                  4.5     4.5     D/2 code bytes + D/16 uint8
    nvfp4             SGLang NVFP4KVQuantizeUtil (FlashInfer fp4_quantize)  4.5  4.5     D/2 + D/16 fp8 (+ fp32/layer)
    int4_per_token_head (asym)  vLLM int4_per_token_head (PR #40835)     4.5     4.5     D/2 + 4 (fp32 scale, zp inside)
    int4_per_token_head (sym)   the same, symmetric                      4.5     4.5     D/2 + 4 (fp32 scale)
    turboquant        vLLM TurboQuant (PR #38479) presets            see turboquant()

Sources, read for this file:
- SGLang 0.5.23, sglang/srt/layers/quantization/kvfp4_tensor.py (FP4MXBlock16KVQuantizeUtil.batched_quantize /
  batched_dequantize; NVFP4KVQuantizeUtil) and fp4_kv_cache_quant_method.py (CPUFP8KVCacheMethod: cache_k / k_scale
  cast to float8_e4m3fn, k_scale 1.0 by default; NVFP4KVCacheMethod: per-layer fp32 global scales, 1.0 unless the
  checkpoint has calibrated KV scales; FP4MXBlock16KVCacheMethod: a [tokens, H * D / 16] uint8 scale buffer).
- FlashInfer fp4_quantize (SGLang's SM90 NVFP4 path; TensorRT-LLM's cvt_warp_fp16_to_fp4 recipe): block scale
  SF = e4m3(vecmax / 6 * SFScaleVal) with SFScaleVal = 1 / global_scale, elements x / (SF / SFScaleVal) rounded
  to E2M1 nearest-even and saturated at 6; dequant x = e2m1 * SF * global_scale.
- vLLM vllm/v1/attention/ops/int4_per_token_head.py (as merged from PR #40835, "Triton INT4 per-token-head KV cache
  quantization"; its description: "INT4 (RHT + asymmetric)"): keys and values pre-rotated by one randomized
  Hadamard transform H (D x) (unnormalized, +-1 signs from a seeded generator), then per (token, head) min/max
  asymmetric 4-bit, scale = max((max - min) / 15, 1e-6), zero point round(-min / scale) in [0, 15] stored in the
  low 4 mantissa bits of the fp32 scale, codes round(x / scale + zp) rounded half away from zero; read back as
  (code - zp) * scale with the 4 low bits cleared; q gets the same transform and the output the inverse / D.
  The symmetric form (not shipped by vLLM at 4 bits; its int8/fp8_per_token_head scheme, absmax / qmax with an fp32
  scale per token and head) uses the same transform, scale = max(absmax / 7, 1e-6), codes in [-8, 7].
- vLLM TurboQuant (PR #38479 "[Attention Backend] TurboQuant: 2-bit KV cache compression with 4x capacity", its
  description and vllm/model_executor/layers/quantization/turboquant/{config,centroids,quantizer}.py and
  vllm/v1/attention/ops/triton_turboquant_store.py): see turboquant().
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from sgl_kvq.quant import pack
from sgl_kvq.quant.bitpack import pack_bits, unpack_bits
from sgl_kvq.quant.compressed import CompressedKV, check_kv
from sgl_kvq.quant.rotation import random_orthogonal, rht_signs, sylvester_hadamard

FP8_MAX = 448.0  # largest finite float8_e4m3fn
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitudes of codes 0..7; bit 3 is the sign
E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # midpoints between neighbouring magnitudes


def _none_kept(T: int, H: int) -> torch.Tensor:
    return torch.zeros(T, H, dtype=torch.bool)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """Triton's (x +- 0.5).to(int32) rounding: half away from zero."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def _e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """uint8 4-bit E2M1 codes -> float32 values (sign in bit 3)."""
    mag = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)[(codes & 0x07).long()]
    return torch.where((codes & 0x08) != 0, -mag, mag)


def _pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., N] uint8 in [0, 16) -> [..., N / 2]: element 2i in the low nibble, 2i + 1 in the high one."""
    return pack.pack(codes.contiguous(), 4)


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return pack.unpack(packed, 4)


# --- fp8_e4m3 ------------------------------------------------------------------------------------------------------

def fp8_e4m3(k: torch.Tensor, v: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> CompressedKV:
    """SGLang's fp8_e4m3 KV: x / scale cast to torch.float8_e4m3fn (round to nearest even, saturating at 448 in this
    torch), read back as fp8 * scale. Scale 1.0 is SGLang's default without calibrated KV scales. 8 bits/element,
    no metadata: 2 * H * D bytes per token and layer."""
    T, H, _ = check_kv(k, v)
    kf = (k.float() / k_scale).to(torch.float8_e4m3fn)
    vf = (v.float() / v_scale).to(torch.float8_e4m3fn)
    return CompressedKV(kf.float() * k_scale, vf.float() * v_scale, {"k.fp8": kf, "v.fp8": vf}, _none_kept(T, H))


# --- SGLang fp4_mx_block16 -----------------------------------------------------------------------------------------

def fp4_mx_block16_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, M, N] -> (packed uint8 [B, M, N / 2], scale uint8 [B, M * N / 16]); SGLang's batched_quantize arithmetic.

    Blocks are 16 consecutive elements of the flattened [M, N] row (for KV [tokens, heads, head_dim]: 16 channels of
    one head). Scale: a power of two 2**e with e = ceil(log2(max(amax / 6, 1e-10))), stored as e + 127 in a uint8;
    codes: E2M1 of x / 2**e, magnitude = number of E2M1_BOUNDS at or below |x| (ties round up), sign bit 3.
    Computed in fp32 whatever x's dtype, as SGLang's torch.compile'd kernel does (inductor upcasts bf16 loads; the
    uncompiled function would round the intermediates to bf16 and can differ)."""
    b, m, n = x.shape
    blocks = x.float().reshape(b, m * n // 16, 16)
    block_max = blocks.abs().max(dim=-1, keepdim=True).values
    scale_exp = torch.ceil(torch.log2(torch.clamp(block_max / E2M1_MAX, min=1e-10)))
    scale = (scale_exp + 127).squeeze(-1).to(torch.uint8)
    scaled = blocks / torch.exp2(scale_exp)
    sign = (scaled < 0).to(torch.uint8) << 3
    bounds = torch.tensor(E2M1_BOUNDS, dtype=torch.float32, device=x.device)
    mag = torch.sum(scaled.abs().unsqueeze(-1) >= bounds, dim=-1).to(torch.uint8)
    codes = (sign + mag).reshape(b, m, n)
    packed = (codes[..., 1::2] << 4) + codes[..., 0::2]
    return packed, scale


def fp4_mx_block16_dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of fp4_mx_block16_quantize -> float32 [B, M, N] (SGLang's batched_dequantize before its final cast)."""
    b, m, nh = packed.shape
    codes = torch.empty(b, m, 2 * nh, dtype=torch.uint8, device=packed.device)
    codes[..., 0::2] = packed & 0x0F
    codes[..., 1::2] = (packed >> 4) & 0x0F
    vals = _e2m1_decode(codes).reshape(b, m * 2 * nh // 16, 16)
    return (vals * torch.exp2(scale.float() - 127).unsqueeze(-1)).reshape(b, m, 2 * nh)


def fp4_mx_block16(k: torch.Tensor, v: torch.Tensor) -> CompressedKV:
    """SGLang --kv-cache-dtype fp4_mx_block16: E2M1 codes, one exponent-only uint8 scale per 16 elements.
    4 + 8 / 16 = 4.5 bits/element: H * D / 2 code bytes + H * D / 16 scale bytes per token, K and V each."""
    T, H, D = check_kv(k, v)
    stored, hats = {}, {}
    for name, x in (("k", k), ("v", v)):
        codes, scale = fp4_mx_block16_quantize(x.float().contiguous())
        stored[f"{name}.codes"], stored[f"{name}.scale"] = codes, scale
        hats[name] = fp4_mx_block16_dequantize(codes, scale)
    return CompressedKV(hats["k"], hats["v"], stored, _none_kept(T, H))


# --- SGLang nvfp4 --------------------------------------------------------------------------------------------------

def e2m1_round(y: torch.Tensor) -> torch.Tensor:
    """float -> 4-bit E2M1 codes, round to nearest with ties to the even code, saturating at +-6
    (cvt.rn.satfinite.e2m1x2.f32). A tie at boundary i goes to the even one of codes i and i + 1."""
    a = y.abs().unsqueeze(-1)
    b = torch.tensor(E2M1_BOUNDS, dtype=torch.float32, device=y.device)
    # tie at b_i -> code i (strict >) when i is even
    even_low = torch.arange(len(E2M1_BOUNDS), device=y.device) % 2 == 0
    mag = torch.where(even_low, a > b, a >= b).sum(-1).to(torch.uint8)
    return mag | (torch.signbit(y).to(torch.uint8) << 3)


def nvfp4_quantize(x: torch.Tensor, global_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N] -> (packed uint8 [..., N / 2], block scales float8_e4m3fn [..., N / 16]); x ~ e2m1 * scale * gs.

    FlashInfer fp4_quantize(x, 1 / global_scale, sf_vec_size=16, sf_use_ue8m0=False) as SGLang's SM90 path calls it:
    SF = e4m3(amax16 / 6 / gs) (nearest even, saturating), codes = e2m1(x / (SF * gs))."""
    *lead, n = x.shape
    blocks = x.float().reshape(*lead, n // 16, 16)
    sf_scale_val = torch.tensor(1.0 / global_scale, dtype=torch.float32)
    vec_max = blocks.abs().amax(-1, keepdim=True)
    sf = (sf_scale_val * (vec_max * (1.0 / E2M1_MAX))).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    sf_f = sf.float()
    out_scale = torch.where(sf_f != 0, 1.0 / (sf_f * (1.0 / sf_scale_val)), torch.zeros_like(sf_f))
    codes = e2m1_round(blocks * out_scale).reshape(*lead, n)
    return _pack_nibbles(codes), sf.squeeze(-1)


def nvfp4_dequantize(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: float) -> torch.Tensor:
    """e2m1 * block scale * global scale, float32 [..., N] (SGLang's SM90 NVFP4 dequantize)."""
    vals = _e2m1_decode(_unpack_nibbles(packed))
    *lead, n = vals.shape
    out = vals.reshape(*lead, n // 16, 16) * block_scale.float().unsqueeze(-1)
    return (out.reshape(*lead, n) * torch.tensor(global_scale, dtype=torch.float32))


def nvfp4(k: torch.Tensor, v: torch.Tensor, global_scale: str | float = "amax") -> CompressedKV:
    """SGLang --kv-cache-dtype nvfp4: E2M1 codes, an FP8-E4M3 scale per 16 elements, one fp32 global scale per layer
    and tensor (K, V). global_scale="amax" is what a calibrated checkpoint supplies (amax / (6 * 448) over the layer's
    tensor, here measured on the same tokens: an optimistic calibration); a number is used as is (SGLang uses 1.0 when
    the checkpoint has no KV scales, as SmolLM2's has not). 4 + 8 / 16 = 4.5 bits/element plus 4 bytes per layer and
    tensor: H * D / 2 + H * D / 16 bytes per token, K and V each."""
    T, H, D = check_kv(k, v)
    stored, hats = {}, {}
    for name, x in (("k", k), ("v", v)):
        if global_scale == "amax":
            amax = float(x.float().abs().max()) if x.numel() else 0.0
            gs = torch.tensor(amax / (E2M1_MAX * FP8_MAX) if amax > 0 else 1.0, dtype=torch.float32)
        else:
            gs = torch.tensor(float(global_scale), dtype=torch.float32)
        codes, sf = nvfp4_quantize(x, float(gs))
        stored.update({f"{name}.codes": codes, f"{name}.scale": sf, f"{name}.global_scale": gs.reshape(1)})
        hats[name] = nvfp4_dequantize(codes, sf, float(gs))
    return CompressedKV(hats["k"], hats["v"], stored, _none_kept(T, H))


# --- vLLM int4_per_token_head --------------------------------------------------------------------------------------

def rht(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """vLLM's single_rht: H (D1 x) forward, (H x) D1 inverse, with H the unnormalized Sylvester-Hadamard matrix
    (norm sqrt(D)), so rht(rht(x), inverse=True) = D x."""
    d = x.shape[-1]
    h, s = sylvester_hadamard(d), rht_signs(d)
    return (x.float() @ h) * s if inverse else (x.float() * s) @ h


def int4_per_token_head(k: torch.Tensor, v: torch.Tensor, symmetric: bool = False) -> CompressedKV:
    """vLLM int4_per_token_head (PR #40835): RHT along head_dim, then one 4-bit scale per (token, KV head) over D.

    Asymmetric (vLLM's): fp32 scale (max - min) / 15 with the 4-bit zero point in its 4 low mantissa bits.
    Symmetric: fp32 scale absmax / 7, signed codes. Either way D / 2 code bytes + 4 scale bytes per token and head:
    4 + 32 / D bits/element (4.5 at D = 64). k_hat / v_hat are the dequantized codes with the inverse RHT applied
    (1 / D folded in), which attention with the original q reproduces (sgl_kvq.quant.rotation)."""
    T, H, D = check_kv(k, v)
    stored, hats = {}, {}
    for name, x in (("k", k), ("v", v)):
        y = rht(x)
        if symmetric:
            scale = torch.clamp(y.abs().amax(-1, keepdim=True) / 7.0, min=1e-6)
            q = torch.clamp(_round_half_away(y / scale), -8, 7)
            codes = (q.to(torch.int16) & 0xF).to(torch.uint8)
            stored_scale = scale.squeeze(-1)
            y_hat = q * scale
        else:
            lo, hi = y.amin(-1, keepdim=True), y.amax(-1, keepdim=True)
            scale = torch.clamp((hi - lo) / 15.0, min=1e-6)
            zp = torch.clamp(_round_half_away(-lo / scale), 0.0, 15.0)
            q = torch.clamp(_round_half_away(y * (1.0 / scale) + zp), 0.0, 15.0)
            codes = q.to(torch.uint8)
            bits = scale.squeeze(-1).contiguous().view(torch.int32)
            stored_scale = ((bits & -16) | zp.squeeze(-1).to(torch.int32)).view(torch.float32)
            sbits = stored_scale.view(torch.int32)
            zp_r = (sbits & 0xF).float().unsqueeze(-1)
            scale_r = (sbits & -16).view(torch.float32).unsqueeze(-1)
            y_hat = (q - zp_r) * scale_r
        stored[f"{name}.codes"], stored[f"{name}.scale"] = _pack_nibbles(codes), stored_scale
        hats[name] = rht(y_hat, inverse=True) / D
    return CompressedKV(hats["k"], hats["v"], stored, _none_kept(T, H))


# --- vLLM TurboQuant -----------------------------------------------------------------------------------------------

TQ_PRESETS = {  # vLLM's TQ_PRESETS (key bits 8 = fp8 keys); value_mode "mse" is the paper's form for values too
    "turboquant_k8v4": dict(key_bits=8, value_bits=4, norm_correction=False),
    "turboquant_4bit_nc": dict(key_bits=4, value_bits=4, norm_correction=True),
    "turboquant_k3v4_nc": dict(key_bits=3, value_bits=4, norm_correction=True),
    "turboquant_3bit_nc": dict(key_bits=3, value_bits=3, norm_correction=True),
}


@lru_cache(maxsize=32)
def lloyd_max(d: int, bits: int, max_iter: int = 200, tol: float = 1e-10) -> tuple[torch.Tensor, torch.Tensor]:
    """(centroids [2**bits], midpoints [2**bits - 1]) float32 of the Lloyd-Max quantizer for N(0, 1/d), the
    distribution of one coordinate of a rotated unit vector; vLLM's solve_lloyd_max (trapezoid integrals of 200
    steps per cell, outer cells cut at +-10.5 sigma, start uniform on +-3.5 sigma), vectorized."""
    n_levels = 2 ** bits
    sigma2 = 1.0 / d
    sigma = math.sqrt(sigma2)
    lo, hi = -3.5 * sigma, 3.5 * sigma
    c = torch.tensor([lo + (hi - lo) * (i + 0.5) / n_levels for i in range(n_levels)], dtype=torch.float64)
    steps = torch.arange(201, dtype=torch.float64)
    w = torch.ones(201, dtype=torch.float64)
    w[0] = w[-1] = 0.5

    def pdf(x):
        return torch.exp(-x * x / (2 * sigma2)) / math.sqrt(2 * math.pi * sigma2)

    for _ in range(max_iter):
        edges = torch.cat([torch.tensor([lo * 3], dtype=torch.float64), (c[:-1] + c[1:]) / 2,
                           torch.tensor([hi * 3], dtype=torch.float64)])
        a, b = edges[:-1, None], edges[1:, None]
        h = (b - a) / 200
        x = a + steps * h
        den = (pdf(x) * w).sum(-1) * h.squeeze(-1)
        num = (x * pdf(x) * w).sum(-1) * h.squeeze(-1)
        new = torch.where(den > 1e-15, num / den.clamp(min=1e-300), c)
        if float((new - c).abs().max()) < tol:
            break
        c = new
    return c.float(), ((c[:-1] + c[1:]) / 2).float()


def _tq_mse(x: torch.Tensor, bits: int, rot: torch.Tensor, norm_correction: bool):
    """TurboQuant_mse of x [T, H, D]: fp16 norm, rotated unit vector coded per coordinate by Lloyd-Max levels.
    -> (packed codes [T, H, D * bits / 8], norm fp16 [T, H], x_hat fp32)."""
    d = x.shape[-1]
    cent, mids = lloyd_max(d, bits)
    norm = x.float().norm(dim=-1, keepdim=True)
    y = (x.float() / norm.clamp(min=1e-12)) @ rot.T  # vLLM: x_hat @ Pi^T
    idx = torch.bucketize(y, mids, right=True).clamp(max=2 ** bits - 1).to(torch.uint8)  # midpoints <= y
    packed = pack_bits(idx, bits)
    norm16 = norm.squeeze(-1).to(torch.float16)
    c = cent[unpack_bits(packed, bits, d).long()]
    if norm_correction:
        c = c / c.norm(dim=-1, keepdim=True).clamp(min=1e-12)
    return packed, norm16, (c @ rot) * norm16.float().unsqueeze(-1)


def _tq_uniform(x: torch.Tensor, bits: int):
    """vLLM TurboQuant's values: min/max over D per vector, codes trunc((x - min) / scale + 0.5), fp16 scale and
    zero (= min). -> (packed [T, H, D * bits / 8], scale fp16 [T, H], zero fp16 [T, H], x_hat fp32)."""
    xf = x.float()
    lo, hi = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
    scale = (hi - lo) / float(2 ** bits - 1)
    scale = torch.where(scale > 1e-8, scale, torch.full_like(scale, 1e-8))
    q = torch.clamp(torch.floor((xf - lo) / scale + 0.5), 0, 2 ** bits - 1).to(torch.uint8)
    packed = pack_bits(q, bits)
    s16, z16 = scale.squeeze(-1).to(torch.float16), lo.squeeze(-1).to(torch.float16)
    x_hat = unpack_bits(packed, bits, x.shape[-1]).float() * s16.float().unsqueeze(-1) + z16.float().unsqueeze(-1)
    return packed, s16, z16, x_hat


def turboquant(k: torch.Tensor, v: torch.Tensor, *, key_bits: int = 3, value_bits: int = 3,
               norm_correction: bool = True, value_mode: str = "uniform", seed: int = 42) -> CompressedKV:
    """TurboQuant as vLLM PR #38479 ships it (--kv-cache-dtype turboquant_*), or with TurboQuant_mse values too.

    Keys (key_bits 3 or 4): the norm ||k|| in fp16; the unit vector rotated by one seeded random orthogonal matrix
    (Haar, QR of a seed-42 Gaussian, vLLM's generate_rotation_matrix; the kernels merged later use a Hadamard
    instead) and each coordinate coded by the Lloyd-Max levels of N(0, 1/D); read back as centroids, renormalized to
    unit length when norm_correction ("_nc"), rotated back and scaled by the norm. ceil(D * b / 8) + 2 bytes per
    token and head. key_bits 8: keys cast to fp8 e4m3 (turboquant_k8v4), D bytes.
    Values, value_mode "uniform" (vLLM): value_bits-bit min/max per vector over D, fp16 scale and zero:
    ceil(D * b / 8) + 4 bytes. value_mode "mse": coded like the keys (the paper's TurboQuant_mse on V too).
    Per token and layer at D = 64, H KV heads: turboquant_3bit_nc 54 H bytes (3.375 bits/element), 4bit_nc 70 H
    (4.375), k3v4_nc 62 H (3.875), k8v4 100 H (6.25); mse values at 3 / 4 bits: 52 H (3.25) / 68 H (4.25).
    vLLM also leaves the first and last 2 layers of a dense model unquantized by default (boundary protection);
    this function quantizes whatever layer it is given."""
    T, H, D = check_kv(k, v)
    rot = random_orthogonal(D, seed)
    stored = {}
    if key_bits == 8:
        kf = k.float().to(torch.float8_e4m3fn)
        stored["k.fp8"], k_hat = kf, kf.float()
    else:
        stored["k.codes"], stored["k.norm"], k_hat = _tq_mse(k, key_bits, rot, norm_correction)
    if value_mode == "mse":
        stored["v.codes"], stored["v.norm"], v_hat = _tq_mse(v, value_bits, rot, norm_correction)
    elif value_mode == "uniform":
        stored["v.codes"], stored["v.scale"], stored["v.zero"], v_hat = _tq_uniform(v, value_bits)
    else:
        raise ValueError(f"value_mode must be 'uniform' or 'mse', got {value_mode!r}")
    return CompressedKV(k_hat, v_hat, stored, _none_kept(T, H))


def turboquant_preset(k: torch.Tensor, v: torch.Tensor, preset: str) -> CompressedKV:
    """One of vLLM's named presets (TQ_PRESETS), e.g. "turboquant_3bit_nc"."""
    return turboquant(k, v, **TQ_PRESETS[preset])
