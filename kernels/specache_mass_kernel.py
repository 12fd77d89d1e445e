"""Jitted code of SpeCache's top-k mass (launcher: specache_decode.head_mass; torch reference: head_mass_ref).

Program (b, kv_head, block of positions): the speculative row's scores of the KV head's GROUP query heads over
BLOCK_T positions (log2 units, specache_decode_kernel.py), normalized by each head's merged lse and summed over the
group: one read of the scores instead of torch's exp / sum / where passes over them. Positions at or past the
request's base tokens are not read (the decode kernel leaves them unwritten) and get mass -1, below any real mass.
With FOLLOW the real rows' mass at the position before (FS, FLSE: the output lane's scores and lse) is added: the
row after each position the real token read is a candidate for the next step. With WINDOW (a sliding layer) the
positions before FIRST[b], the speculative row's first visible one, are not read either and get -1.
"""

import triton
import triton.language as tl


@triton.jit
def _head_mass_kernel(S, LSE, FS, FLSE, BASE, FIRST, M, T, stride_sb, stride_sh, stride_lb, stride_mb, stride_mh,
                      GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, FOLLOW: tl.constexpr,
                      WINDOW: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    offs_t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_g = tl.arange(0, BLOCK_G)
    heads = kvh * GROUP + offs_g
    mask_g = offs_g < GROUP
    in_base = offs_t < tl.load(BASE + b)
    if WINDOW:
        in_base = in_base & (offs_t >= tl.load(FIRST + b))
    lse2 = tl.load(LSE + b * stride_lb + heads, mask=mask_g, other=0.0) * 1.4426950408889634
    s = tl.load(S + b * stride_sb + heads[:, None] * stride_sh + offs_t[None, :],
                mask=mask_g[:, None] & in_base[None, :], other=float("-inf"))
    mass = tl.sum(tl.exp2(s - lse2[:, None]), axis=0)
    if FOLLOW:  # FS/FLSE share S/LSE's strides (two halves of one lane-major buffer)
        flse2 = tl.load(FLSE + b * stride_lb + heads, mask=mask_g, other=0.0) * 1.4426950408889634
        before = in_base & (offs_t >= 1)
        fs = tl.load(FS + b * stride_sb + heads[:, None] * stride_sh + offs_t[None, :] - 1,
                     mask=mask_g[:, None] & before[None, :], other=float("-inf"))
        mass += tl.sum(tl.exp2(fs - flse2[:, None]), axis=0)
    tl.store(M + b * stride_mb + kvh * stride_mh + offs_t, tl.where(in_base, mass, -1.0), mask=offs_t < T)
