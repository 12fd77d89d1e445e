"""SpeCache's fused decode lanes (kernels/specache_decode.py) against the torch lanes (sgl_kvq/specache/attention.py,
the semantic oracle) on the same quantized pool: output rows, speculative rows, and the next top-k positions.

Tolerances are the kernel's arithmetic only, as in tests/kernels/test_kernels_attention.py.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any triton import (tests/conftest.py does the same)

import pytest  # noqa: E402

from sgl_kvq.attention_ref import attention_probs, gather_context  # noqa: E402
from sgl_kvq.kernels import specache_decode as sd  # noqa: E402
from sgl_kvq.specache.attention import output_rows, speculative_rows, with_topk  # noqa: E402
from kernel_checks import DEVICE, TOL, assert_close_written, to_device  # noqa: E402
from sgl_kvq.specache.topk_rows import TopKRows  # noqa: E402
from paged_pool import make_pool  # noqa: E402
from slices import covering_pairs  # noqa: E402

DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])

# (G, H, group, D, VG, top_k, requests as (base tokens, overlay tokens)): odd lengths, GQA, a context shorter than a
# page (base-only and frame-only), top-k larger than a context.
CASES = {
    "G16-mha-odd-k5": (16, 2, 1, 64, 64, 5, [(0, 5), (48, 13), (160, 16), (37, 0)]),
    "G32-gqa3-k24": (32, 1, 3, 128, 32, 24, [(0, 40), (64, 1), (7, 0), (95, 0)]),
    "G16-gqa4-k40-short": (16, 2, 4, 64, 16, 40, [(11, 0), (32, 9), (0, 1)]),
    "G16-one-request": (16, 2, 3, 64, 32, 7, [(80, 21)]),
}


def _topk_buffers(n, H, K, D, base, dtype, gen):
    """Prefetched rows in request slots (a shuffled subset of R = 2n + 1), with positions that are distinct per head:
    some padding (-1), some past the request's base (ignored), the rest inside it. -> (k, v [R, H, K, D],
    pos [R, H, K], req [n])."""
    R = 2 * n + 1
    req = torch.randperm(R, generator=gen)[:n]
    tk = torch.randn(R, H, K, D, generator=gen).to(dtype)
    tv = torch.randn(R, H, K, D, generator=gen).to(dtype)
    pos = torch.full((R, H, K), -1, dtype=torch.int64)
    for b in range(n):
        for h in range(H):
            cand = torch.randperm(base[b] + 6, generator=gen)[:K]
            cand[torch.rand(cand.shape, generator=gen) < 0.2] = -1
            pos[req[b], h, :cand.numel()] = cand
    return tk, tv, pos, req


def framed_topk(tk, tv, pos, req, rows_per_frame, gen) -> sd.TopK:
    """The same rows laid out as pooled top-k rows are (sgl_kvq/specache/topk_rows.py), written through TopKRows'
    own addressing: slot r's row j in frame table[r, j // C], row j % C, the frames shuffled; every other row of
    the frames (the last frame's rows past K, frame 0) holds random rows at small positions, inside most bases,
    which the kernel must not read."""
    R, H, K, D = tk.shape
    C = rows_per_frame
    m = -(-K // C)
    F = R * m + 1
    table = (torch.randperm(R * m, generator=gen) + 1).view(R, m)
    rows = TopKRows(torch.randn(1, F, C, H, D, generator=gen).to(tk.dtype),
                    torch.randn(1, F, C, H, D, generator=gen).to(tk.dtype),
                    torch.randint(0, 4, (1, F, C, H), generator=gen), table, K)
    slots = torch.arange(R)
    rows.set_positions(0, slots, pos)
    fk, fv, out_rows = rows.flat_rows(0, slots)
    fk[out_rows.reshape(-1)] = tk.reshape(-1, D)
    fv[out_rows.reshape(-1)] = tv.reshape(-1, D)
    back = rows.rows(0, slots)
    assert all(torch.equal(a, b) for a, b in zip(back, (tk, tv, pos)))
    return sd.TopK(*(t.to(DEVICE) for t in rows.layer(0)), req.to(DEVICE), K)


def _mass(p_spec, H, n_base, p_real=None):
    m = p_spec[:, :n_base].reshape(H, p_spec.shape[0] // H, n_base).sum(1)
    if p_real is not None and n_base > 1:
        m[:, 1:] += p_real[:, :n_base - 1].reshape(H, p_real.shape[0] // H, n_base - 1).sum(1)
    return m


@pytest.mark.parametrize("case,dtype", covering_pairs(list(CASES), DTYPES))
@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("lanes,follow", [(2, False), (2, True), (1, False)])
def test_lanes_match_torch(case, bits, dtype, lanes, follow):
    G, H, group, D, VG, K, reqs = CASES[case]
    kv, paged = make_pool(G, H, D, VG, bits, reqs, dtype, seed=bits + 7)
    n, Hq = len(reqs), H * group
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(lanes * n, Hq, D, generator=gen).to(dtype)
    # own K/V as the engine hands them over: views with different row strides (k and v of one fused projection)
    kv_own = torch.randn(n, 3, H, D, generator=gen).to(dtype)
    k_own, v_own = kv_own[:, 0] * 1.5, kv_own[:, 2]
    base = [paged.base_len(b, G) for b in range(n)]
    dense = _topk_buffers(n, H, K, D, base, dtype, gen) if lanes == 2 else None
    sm_scale = D ** -0.5

    contexts = [gather_context(kv, paged, b) for b in range(n)]
    if dense is not None:
        tk, tv, tpos, req = dense
        contexts = with_topk(contexts, base, tk[req], tv[req], tpos[req])
    ref_real, real_probs = output_rows(q[:n], contexts, sm_scale)
    ref_spec, ref_pos = speculative_rows(q[(lanes - 1) * n:], k_own, v_own, contexts, base, sm_scale, K,
                                         real_probs if follow else None)
    ref = torch.cat([ref_real, ref_spec]) if lanes == 2 else ref_spec

    p = sd.plan(to_device(paged), n_lanes=lanes, num_qo_heads=Hq, num_kv_heads=H, head_dim=D, page_size=G,
                max_splits=3, min_pages_per_split=1)
    p.o_partial.fill_(float("nan"))
    p.lse_partial.fill_(float("nan"))
    T = max(base) + 3
    scores = torch.full(((2 if follow else 1) * n, Hq, T), float("nan"), device=DEVICE)
    # frames of 3 rows: a request's rows span several frames, its last one partly
    dev_topk = None if dense is None else framed_topk(*dense, rows_per_frame=3, gen=gen)
    out, lse = sd.specache_decode(q.to(DEVICE), k_own.to(DEVICE), v_own.to(DEVICE), to_device(kv), p, dev_topk,
                                  sm_scale, scores, follow=follow)
    assert_close_written(out, ref, dtype)
    assert all(scores[r, :, :base[r % n]].isfinite().all() for r in range(scores.shape[0])), \
        "a base position's score was not written"

    if follow:
        pos = sd.select_topk(scores[n:], lse[n:], p.base_tokens, H, K, follow=(scores[:n], lse[:n])).cpu()
    else:
        pos = sd.select_topk(scores, lse[(lanes - 1) * n:], p.base_tokens, H, K).cpu()
    assert pos.shape == ref_pos.shape
    assert torch.equal(pos < 0, ref_pos < 0), "a different number of positions was selected"
    # Same positions up to near-ties: the reference mass of the kernel's set equals the best set's mass.
    rtol, atol = TOL[dtype]
    for b in range(n):
        k = torch.cat([contexts[b][0], k_own[b:b + 1].float()])
        mass = _mass(attention_probs(q[(lanes - 1) * n + b:(lanes - 1) * n + b + 1], k, sm_scale)[:, 0], H, base[b],
                     real_probs[b] if follow else None)
        for h in range(H):
            got, want = pos[b, h][pos[b, h] >= 0], ref_pos[b, h][ref_pos[b, h] >= 0]
            assert got.unique().numel() == got.numel()
            torch.testing.assert_close(mass[h, got].sum(), mass[h, want].sum(), rtol=10 * rtol, atol=10 * atol)


def _windows(G: int) -> list[int]:
    """With CASES' lengths these cut contexts mid base page, on a base page boundary, at and inside the frames; W = 0
    (the output row's own token, the speculative row's own key) and wider than any context."""
    return [0, 5, G - 1, G + 3, 2 * G + 6, 10 * G]


@pytest.mark.parametrize("lanes_follow,case", covering_pairs([(2, False), (2, True), (1, False)],
                                                             ["G16-mha-odd-k5", "G32-gqa3-k24"]))
def test_lanes_match_torch_under_sliding_windows(case, lanes_follow):
    """A sliding layer: the output row (at its context's last position T - 1) sees T - 1 - W .., the speculative row
    (own key at T) T - W .., prefetched rows included; the kernel against the torch lanes with the same window, its
    scores written at every visible base position, and select_topk (given window_first) choosing inside the
    speculative row's window only, the torch lanes' set up to near-ties. Split-KV with 3 splits starting at the
    window's first page."""
    (lanes, follow), (G, H, group, D, VG, K, reqs) = lanes_follow, CASES[case]
    dtype, bits = torch.float32, 1 + lanes % 2
    kv, paged = make_pool(G, H, D, VG, bits, reqs, dtype, seed=bits + 11)
    n, Hq = len(reqs), H * group
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(lanes * n, Hq, D, generator=gen)
    k_own, v_own = torch.randn(n, H, D, generator=gen) * 1.5, torch.randn(n, H, D, generator=gen)
    base = [paged.base_len(b, G) for b in range(n)]
    total = [paged.seq_len(b, G) for b in range(n)]
    dense = _topk_buffers(n, H, K, D, base, dtype, gen) if lanes == 2 else None
    sm_scale = D ** -0.5
    contexts = [gather_context(kv, paged, b) for b in range(n)]
    if dense is not None:
        tk, tv, tpos, req = dense
        contexts = with_topk(contexts, base, tk[req], tv[req], tpos[req])
    p = sd.plan(to_device(paged), n_lanes=lanes, num_qo_heads=Hq, num_kv_heads=H, head_dim=D, page_size=G,
                max_splits=3, min_pages_per_split=1)
    assert p.context_tokens.tolist() == total
    dev_topk = None if dense is None else framed_topk(*dense, rows_per_frame=3, gen=gen)
    T = max(base) + 3
    for window in _windows(G):
        ref_real, real_probs = output_rows(q[:n], contexts, sm_scale, window=window)
        ref_spec, ref_pos = speculative_rows(q[(lanes - 1) * n:], k_own, v_own, contexts, base, sm_scale, K,
                                             real_probs if follow else None, window=window)
        ref = torch.cat([ref_real, ref_spec]) if lanes == 2 else ref_spec
        p.o_partial.fill_(float("nan"))
        p.lse_partial.fill_(float("nan"))
        scores = torch.full(((2 if follow else 1) * n, Hq, T), float("nan"), device=DEVICE)
        out, lse = sd.specache_decode(q.to(DEVICE), k_own.to(DEVICE), v_own.to(DEVICE), to_device(kv), p, dev_topk,
                                      sm_scale, scores, follow=follow, window=window)
        assert_close_written(out, ref, dtype)
        first = sd.window_first(p, window)
        assert first.tolist() == [max(t - window, 0) for t in total]
        for r in range(scores.shape[0]):  # follow: the output rows' first, seeing one position more
            b, seen = r % n, int(first[r % n]) - int(follow and r < n and first[r % n] > 0)
            assert scores[r, :, seen:base[b]].isfinite().all(), f"W={window}: a visible score was not written"
        if follow:
            pos = sd.select_topk(scores[n:], lse[n:], p.base_tokens, H, K, follow=(scores[:n], lse[:n]), first=first)
        else:
            pos = sd.select_topk(scores, lse[(lanes - 1) * n:], p.base_tokens, H, K, first=first)
        pos = pos.cpu()
        assert torch.equal(pos < 0, ref_pos < 0), f"W={window}: a different number of positions was selected"
        for b in range(n):
            chosen = pos[b][pos[b] >= 0]
            assert bool((chosen >= first[b].cpu()).all()), f"W={window}: a top-k position before the window"
            f = int(first[b])
            keys = torch.cat([contexts[b][0], k_own[b:b + 1]])
            seen = (torch.arange(keys.shape[0]) >= f) if f else None
            mass = _mass(attention_probs(q[(lanes - 1) * n + b:(lanes - 1) * n + b + 1], keys, sm_scale, seen)[:, 0],
                         H, base[b], real_probs[b] if follow else None)
            for h in range(H):
                got, want = pos[b, h][pos[b, h] >= 0], ref_pos[b, h][ref_pos[b, h] >= 0]
                assert got.unique().numel() == got.numel()
                torch.testing.assert_close(mass[h, got].sum(), mass[h, want].sum(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("n,Hq,H,T", [(3, 6, 2, 300), (2, 4, 4, 513)])
def test_head_mass_reads_nothing_before_the_window(n, Hq, H, T):
    """first [n]: scores before it are NaN (never written under a window) and get -1, as past the base."""
    gen = torch.Generator().manual_seed(n + T)
    base = torch.randint(T // 2, T + 1, (n,), generator=gen)
    first = torch.randint(0, T // 2, (n,), generator=gen)
    first[0] = 0
    both = torch.randn(2 * n, Hq, T, generator=gen) * 4
    t = torch.arange(T)[None, None, :]
    both[((t >= base.repeat(2)[:, None, None]) | (t < first.repeat(2)[:, None, None] - 1)).expand(2 * n, Hq, T)] = \
        float("nan")
    both[n:][(t < first[:, None, None]).expand(n, Hq, T)] = float("nan")  # the speculative rows' window, one later
    lse2 = torch.logsumexp(torch.nan_to_num(both, nan=-1e30) / sd.LOG2E, dim=-1)
    want = sd.head_mass_ref(torch.nan_to_num(both[n:], nan=-1e30), lse2[n:], base, H,
                            follow=(torch.nan_to_num(both[:n], nan=-1e30), lse2[:n]), first=first)
    got = sd.head_mass(both[n:].to(DEVICE), lse2[n:].to(DEVICE), base.to(DEVICE), H,
                       follow=(both[:n].to(DEVICE), lse2[:n].to(DEVICE)), first=first.to(DEVICE)).cpu()
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    for b in range(n):
        assert (got[b, :, :first[b]] == -1).all() and (got[b, :, first[b]:base[b]] >= 0).all()


def test_replaced_rows_change_the_output():
    """The kernel reads the 16-bit rows, not the codes, at top-k positions: a prefetched row that differs from the
    codes changes the output rows, and a -1 slot changes nothing."""
    G, H, group, D, VG, K, reqs = CASES["G16-mha-odd-k5"]
    kv, paged = make_pool(G, H, D, VG, 1, reqs, torch.float32, seed=2)
    kv, paged = to_device(kv), to_device(paged)
    n = len(reqs)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2 * n, H * group, D, generator=gen).to(DEVICE)
    own = torch.randn(n, H, D, generator=gen).to(DEVICE)
    base = [paged.base_len(b, G) for b in range(n)]
    tk, tv, tpos, req = (t.to(DEVICE) for t in _topk_buffers(n, H, K, D, base, torch.float32, gen))
    topk = sd.TopK.per_slot(tk, tv, tpos, req)
    p = sd.plan(paged, n_lanes=2, num_qo_heads=H * group, num_kv_heads=H, head_dim=D, page_size=G)
    scores = torch.empty(n, H * group, max(base), device=DEVICE)
    out, _ = sd.specache_decode(q, own, own, kv, p, topk, D ** -0.5, scores)
    none = sd.TopK.per_slot(tk, tv, torch.full_like(tpos, -1), req)
    plain, _ = sd.specache_decode(q, own, own, kv, p, none, D ** -0.5, scores)
    unused, _ = sd.specache_decode(q, own, own, kv, p, None, D ** -0.5, scores)
    torch.testing.assert_close(plain, unused)
    has = [b for b in range(n) if ((tpos[req[b]] >= 0) & (tpos[req[b]] < base[b])).any()]
    assert has and all((out[b] - plain[b]).abs().max() > 1e-3 for b in has)


@pytest.mark.parametrize("follow", [False, True])
@pytest.mark.parametrize("n,Hq,H,T", [(3, 6, 2, 300), (1, 9, 3, 17), (2, 4, 4, 513)])
def test_head_mass_matches_torch(n, Hq, H, T, follow):
    """The Triton mass (one pass over the scores) against its torch reference; scores past each request's base are
    NaN (never written by the decode kernel) and must not leak in. With follow, the output rows' mass one position
    earlier is added (both halves of one lane-major buffer, as the backend passes them)."""
    gen = torch.Generator().manual_seed(n * T)
    base = torch.randint(0, T + 1, (n,), generator=gen)
    base[0] = T  # one request whose base fills the buffer
    both = torch.randn(2 * n, Hq, T, generator=gen) * 4
    both[torch.arange(T)[None, None, :].expand(2 * n, Hq, T) >= base.repeat(2)[:, None, None]] = float("nan")
    lse2 = torch.logsumexp(torch.nan_to_num(both, nan=-1e30) / sd.LOG2E, dim=-1) + torch.rand(2 * n, Hq, generator=gen)
    scores, lse = both[n:], lse2[n:]
    fol = (both[:n], lse2[:n]) if follow else None
    want = sd.head_mass_ref(scores, lse, base, H, follow=fol)
    both_d, lse2_d = both.to(DEVICE), lse2.to(DEVICE)
    got = sd.head_mass(both_d[n:], lse2_d[n:], base.to(DEVICE), H,
                       follow=(both_d[:n], lse2_d[:n]) if follow else None).cpu()
    assert not got.isnan().any()
    torch.testing.assert_close(got, torch.nan_to_num(want, nan=-1.0), rtol=1e-6, atol=1e-7)
    assert (got[0] >= 0).all() and all((got[b, :, base[b]:] == -1).all() for b in range(n))


COMPILE = '''
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sgl_kvq.kernels.specache_decode_kernel import _specache_decode_kernel as fn

names = list(inspect.signature(fn.fn).parameters)
from sgl_kvq.kernels.arg_groups import PageLists, PoolArgs, SplitParts
from sgl_kvq.kernels.specache_decode import TopKArgs

# tuple arguments are typed by a tuple of the same kind; SpeCache pages carry no extras (EXTRAS = (), the identity
# corrections)
from sgl_kvq.formats.plain_kernel import _plain_kt, _plain_v
ptrs = dict(Q="*bf16", KOWN="*bf16", VOWN="*bf16", SCORES="*fp32", num_splits="*i32", EXTRAS=(),
            POOL=PoolArgs("*u8", "*fp16", "*fp16", "*u8", "*fp16", "*fp16", "*bf16", "*bf16", *["i32"] * 12),
            TOPK=TopKArgs("*bf16", "*bf16", "*i64", "*i64", "*i64", *["i32"] * 7), PAGES=PageLists(*["*i32"] * 6),
            PARTS=SplitParts("*fp32", "*fp32", *["i32"] * 5))
# SmolLM2's geometry (GQA 3, D 64, G 64): both lanes with 64 top-k rows at 1 bit; the pre-decode lane at 2 bits
for consts in (dict(GROUP=3, BLOCK_M=16, D=64, G=64, BITS=(1, 1), VG=64, K=64, BLOCK_K=128, BLOCK_P=64, NLANES=2,
                    SPEC_LANE=1, USE_TOPK=True, FOLLOW=True, MAX_SPLITS=8, TOPK_ROWS=64, CORRECT=(_plain_kt, _plain_v),
                    SIZES=(),
                    DOT_FP32=False),
               dict(GROUP=4, BLOCK_M=16, D=128, G=32, BITS=(2, 2), VG=32, K=1, BLOCK_K=16, BLOCK_P=1, NLANES=1,
                    SPEC_LANE=0, USE_TOPK=False, FOLLOW=False, MAX_SPLITS=2, TOPK_ROWS=1, CORRECT=(_plain_kt, _plain_v),
                    SIZES=(),
                    DOT_FP32=False)):
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n == "sm_scale_log2" else "i32") for n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()})
    triton.compile(src, target=GPUTarget("cuda", 90, 32))
    print("compiled", flush=True)
from sgl_kvq.kernels.specache_mass_kernel import _head_mass_kernel as mass
names = list(inspect.signature(mass.fn).parameters)
consts = dict(GROUP=4, BLOCK_G=4, BLOCK_T=256, FOLLOW=True, WINDOW=True)
sig = {n: "constexpr" if n in consts else {"S": "*fp32", "LSE": "*fp32", "FS": "*fp32", "FLSE": "*fp32", "BASE": "*i64",
                                           "FIRST": "*i64", "M": "*fp32"}.get(n, "i32")
       for n in names}
triton.compile(ASTSource(fn=mass, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()}),
               target=GPUTarget("cuda", 90, 32))
print("compiled", flush=True)
'''


def test_specache_kernel_compiles_for_sm90():
    """The interpreter never lowers a kernel: compile both for sm_90 as tests/kernels/test_kernels_compile.py does."""
    import subprocess
    import sys
    from pathlib import Path

    from test_kernels_compile import _has_nvidia_backend

    if not _has_nvidia_backend():
        pytest.skip("this triton build has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", COMPILE], env=env, cwd=root, capture_output=True, text=True,
                       timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert r.stdout.count("compiled") == 3, r.stdout
