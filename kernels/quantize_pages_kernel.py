"""Jitted code of the quantize-and-pack write path (launcher: quantize_pages.py).

Bit-exact with sgl_kvq.quant.kivi_page.pack_pages: every fp32 step the reference takes is taken here in the
same order, the divisions are IEEE (`div_rn`: Triton's plain fp32 `/` is approximate on NVIDIA), and the launcher
turns fp contraction off so `3 * lo + hi` is not fused into an fma.
"""

import triton
import triton.language as tl


@triton.jit
def _round_half_even(y):
    # torch.round rounds half to even. floor(y + 0.5) is wrong twice: at exact halves and when y + 0.5 rounds
    # up in fp32 (y = 0.5 - 2**-25). y - floor(y) is exact for |y| < 2**23, and larger |y| are integers already.
    r = tl.floor(y)
    f = y - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    up = (f > 0.5) | ((f == 0.5) & odd)
    return tl.where(up, r + 1.0, r)


@triton.jit
def _scale_zero(lo, hi, BITS: tl.constexpr, SPECACHE_ONE_BIT: tl.constexpr):
    # sgl_kvq.quant.uniform.scale_zero, fp32 in, fp16 out.
    if BITS == 1 and SPECACHE_ONE_BIT:
        zero = tl.math.div_rn(3.0 * lo + hi, 4.0)
        scale = tl.math.div_rn(hi - lo, 2.0)
    else:
        zero = lo
        scale = tl.math.div_rn(hi - lo, (1 << BITS) - 1.0)
    scale = tl.where(scale > 1e-6, scale, 1e-6)
    scale = tl.minimum(scale, 65504.0).to(tl.float16)
    zero = tl.minimum(tl.maximum(zero, -65504.0), 65504.0).to(tl.float16)
    return scale, zero


@triton.jit
def _encode(x, scale, zero, BITS: tl.constexpr):
    # Codes against the STORED fp16 scale/zero, as uniform.encode does. Returns int32 in [0, 2**BITS).
    y = tl.math.div_rn(x - zero.to(tl.float32), scale.to(tl.float32))
    q = tl.minimum(tl.maximum(_round_half_even(y), 0.0), (1 << BITS) - 1.0)
    return q.to(tl.int32)


@triton.jit
def _pack_rows(codes, ROWS: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    # [ROWS, D] int32 codes -> [ROWS, D * BITS // 8] int32 bytes; element i goes to bit (i % per_byte) * BITS
    # of byte i // per_byte (sgl_kvq.quant.pack: little-endian inside the byte).
    PB: tl.constexpr = 8 // BITS
    grouped = tl.reshape(codes, (ROWS, D // PB, PB))
    shifts = tl.arange(0, PB) * BITS
    return tl.sum(grouped << shifts[None, None, :], axis=2)


@triton.jit
def _store_codes(ptr, rows, codes, ROWS: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    # [ROWS, D] int32 codes packed into the rows starting at ptr + rows [ROWS]; 3 bits: the 2-bit plane of codes & 3,
    # then the 1-bit plane of codes >> 2 (sgl_kvq.quant.pack)
    if BITS == 3:
        tl.store(ptr + rows[:, None] + tl.arange(0, D // 4)[None, :], _pack_rows(codes & 3, ROWS, D, 2).to(tl.uint8))
        tl.store(ptr + rows[:, None] + D // 4 + tl.arange(0, D // 8)[None, :],
                 _pack_rows(codes >> 2, ROWS, D, 1).to(tl.uint8))
    else:
        PB: tl.constexpr = 8 // BITS
        tl.store(ptr + rows[:, None] + tl.arange(0, D // PB)[None, :], _pack_rows(codes, ROWS, D, BITS).to(tl.uint8))


@triton.jit
def _quantize_pages_kernel(
    K, V, src_ids, dst_pages,
    KC, KS, KZ, VC, VS, VZ,
    stride_src_page, stride_srcv_page, stride_src_tok, stride_src_head,
    stride_kc_slot, stride_kc_head, stride_vc_slot, stride_vc_head, stride_ks_page, stride_ks_head,
    stride_vs_slot, stride_vs_head,
    G: tl.constexpr, D: tl.constexpr, VG: tl.constexpr, KBITS: tl.constexpr, VBITS: tl.constexpr,
    SPECACHE_ONE_BIT: tl.constexpr,
):
    # One program per (page, KV head): the whole [G, D] tile of keys and of values is in registers.
    n = tl.program_id(0)
    h = tl.program_id(1)
    src = tl.load(src_ids + n).to(tl.int64)
    dst = tl.load(dst_pages + n).to(tl.int64)
    # Page 0 is SGLang's dummy page: a decode batch names it for rows that complete no page (static grid).
    if dst != 0:
        NG: tl.constexpr = D // VG
        offs_t = tl.arange(0, G)
        offs_d = tl.arange(0, D)
        row = offs_t[:, None] * stride_src_tok + h * stride_src_head + offs_d[None, :]
        slots = dst * G + offs_t

        # keys: per channel over the page's G tokens
        k = tl.load(K + src * stride_src_page + row).to(tl.float32)
        k_scale, k_zero = _scale_zero(tl.min(k, axis=0), tl.max(k, axis=0), KBITS, SPECACHE_ONE_BIT)
        k_codes = _encode(k, k_scale[None, :], k_zero[None, :], KBITS)
        _store_codes(KC, slots * stride_kc_slot + h * stride_kc_head, k_codes, G, D, KBITS)
        tl.store(KS + dst * stride_ks_page + h * stride_ks_head + offs_d, k_scale)
        tl.store(KZ + dst * stride_ks_page + h * stride_ks_head + offs_d, k_zero)

        # values: per token, groups of VG channels
        v = tl.reshape(tl.load(V + src * stride_srcv_page + row).to(tl.float32), (G, NG, VG))
        v_scale, v_zero = _scale_zero(tl.min(v, axis=2), tl.max(v, axis=2), VBITS, SPECACHE_ONE_BIT)
        v_codes = tl.reshape(_encode(v, v_scale[:, :, None], v_zero[:, :, None], VBITS), (G, D))
        _store_codes(VC, slots * stride_vc_slot + h * stride_vc_head, v_codes, G, D, VBITS)
        vs_off = slots[:, None] * stride_vs_slot + h * stride_vs_head + tl.arange(0, NG)[None, :]
        tl.store(VS + vs_off, v_scale)
        tl.store(VZ + vs_off, v_zero)
