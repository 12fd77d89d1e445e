"""SpeCache under sliding-window layers (SGLang's `sliding_window_size` W: a query at position i sees i - W .. i):
the output row (at its context's last position T - 1) sees T - 1 - W .. T - 1, the speculative row (its own key one
position later, at T) sees T - W .. T, prefetched 16-bit rows included, and the next top-k is chosen among base
positions >= T - W only (the window of the output row that reads them next step).

- the oracle (sgl_kvq/specache/attention.py) against the lanes computed here from the visible keys alone (each row's
  keys sliced at its window, the top-k ranked over that slice): windows that end mid base page, on a page boundary,
  inside the fp16 frames, W = 0 and wider than the context;
- kvq_torch's batched lanes (sgl_kvq/specache/attention_batched.py) against the oracle, and no top-k position before
  the window;
- kvq_torch's specache backend driven as SGLang drives it on a windowed layer: the extend reads its 16-bit prefix
  within the window, the pre-decode and a two-lane step attend within it and prefetch inside it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from paged_pool import SHAPES, make_pool
from sgl_kvq import attention_extend, padded
from sgl_kvq.attention_ref import _attend, attention_probs, gather_context, ref_extend, visible_from, window_mask
from sgl_kvq.specache import attention as oracle
from sgl_kvq.specache import attention_batched as lanes

TOL = dict(rtol=1e-5, atol=1e-5)


def requests(G: int) -> list[tuple[int, int]]:
    """(base tokens, overlay tokens): whole base pages then frames; a partial last base page and no frame; frames
    only; a base and a two-token frame."""
    return [(3 * G, G + 5), (2 * G + 7, 0), (0, G + 3), (4 * G, 2)]


def windows(G: int) -> list[int]:
    return [0, 1, 3, G - 1, G, G + 2, G + 4, G + 5, 2 * G + 3, 3 * G, 10 * G]


def cut(first: int, n_base: int, T: int, G: int) -> str:
    """Where a row's window starts in its context of T tokens (n_base of them packed)."""
    if first == 0:
        return "whole context"
    if first == T:
        return "own key only"
    if first >= n_base:
        return "inside the frames"
    return "page boundary" if first % G == 0 else "mid page"


def test_the_windows_cut_every_kind_of_place():
    for G, *_ in SHAPES:
        kinds = set()
        for b, o in requests(G):
            T = b + o
            for w in windows(G):
                kinds |= {cut(visible_from(T - 1, w), b, T, G), cut(visible_from(T, w), b, T, G)}
        assert kinds == {"whole context", "own key only", "inside the frames", "page boundary", "mid page"}, G


def case(G, H, D, VG, bits, group, top_k, seed):
    gen = torch.Generator().manual_seed(seed)
    reqs = requests(G)
    B = len(reqs)
    kv, plan = make_pool(G, H, D, VG, bits, reqs, torch.float32, seed=seed)
    n_base = [plan.base_len(b, G) for b in range(B)]
    q = torch.randn(2 * B, H * group, D, generator=gen)
    k_own, v_own = torch.randn(B, H, D, generator=gen) * 1.5, torch.randn(B, H, D, generator=gen)
    # prefetched rows: distinct positions per head, anywhere in the base (before the window too), some -1
    tk, tv = torch.randn(B, H, top_k, D, generator=gen) * 1.5, torch.randn(B, H, top_k, D, generator=gen)
    tpos = torch.full((B, H, top_k), -1, dtype=torch.int64)
    for b in range(B):
        for h in range(H):
            cand = torch.randperm(n_base[b] + 3, generator=gen)[:top_k]
            cand[torch.rand(cand.shape, generator=gen) < 0.2] = -1
            tpos[b, h, :cand.numel()] = cand
    return kv, plan, n_base, q, k_own, v_own, (tk, tv, tpos)


def visible_lanes(q_real, q_spec, k_own, v_own, contexts, n_base, sm_scale, top_k, window, follow):
    """The lanes from each row's visible keys alone: (real out, spec out, per request the speculative ranking mass
    [H, n_base] and its candidate positions first..n_base - 1)."""
    H = k_own.shape[1]
    real, spec, ranks = [], [], []
    for b, (k, v) in enumerate(contexts):
        T = k.shape[0]
        fr, fs = visible_from(T - 1, window), visible_from(T, window)
        real.append(_attend(q_real[b:b + 1], k[fr:], v[fr:], sm_scale)[0] if q_real is not None else None)
        ks, vs = torch.cat([k[fs:], k_own[b:b + 1]]), torch.cat([v[fs:], v_own[b:b + 1]])
        spec.append(_attend(q_spec[b:b + 1], ks, vs, sm_scale)[0])
        p = torch.zeros(q_spec.shape[1], T)
        p[:, fs:] = attention_probs(q_spec[b:b + 1], ks, sm_scale)[:, 0, :T - fs]
        mass = p[:, :n_base[b]].reshape(H, q_spec.shape[1] // H, n_base[b]).sum(1)
        if follow and n_base[b] > 1:
            pr = torch.zeros(q_real.shape[1], T)
            pr[:, fr:] = attention_probs(q_real[b:b + 1], k[fr:], sm_scale)[:, 0]
            mass[:, 1:] += pr[:, :n_base[b] - 1].reshape(H, q_real.shape[1] // H, n_base[b] - 1).sum(1)
        ranks.append((mass, fs))
    return real, spec, ranks


def assert_top_k(pos, ranks, n_base, top_k):
    """pos [B, H, K]: per request and head, min(K, visible base positions) distinct positions first <= t < n_base,
    -1 padded, and their mass the best such set's (equal up to fp near-ties)."""
    for b, (mass, first) in enumerate(ranks):
        n = min(top_k, max(n_base[b] - first, 0))
        for h in range(pos.shape[1]):
            got = pos[b, h][pos[b, h] >= 0]
            assert got.numel() == n and got.unique().numel() == n, (b, h, got, n)
            assert bool(((got >= first) & (got < n_base[b])).all()), f"a top-k position before the window: {got}"
            if n:
                best = mass[h, first:].topk(n).values.sum()
                torch.testing.assert_close(mass[h, got].sum(), best, rtol=0, atol=1e-6)


@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_the_oracle_attends_and_ranks_within_each_rows_window(shape):
    G, H, D, VG = SHAPES[shape]
    top_k = 5
    kv, plan, n_base, q, k_own, v_own, (tk, tv, tpos) = case(G, H, D, VG, 2, 2, top_k, seed=shape)
    B, sm_scale = len(n_base), D ** -0.5
    stored = [gather_context(kv, plan, b) for b in range(B)]
    contexts = oracle.with_topk(stored, n_base, tk, tv, tpos)
    for window in windows(G):
        # pre-decode: the real tokens as speculative rows over the stored context
        out, pos = oracle.speculative_rows(q[:B], k_own, v_own, stored, n_base, sm_scale, top_k, window=window)
        _, want, ranks = visible_lanes(None, q[:B], k_own, v_own, stored, n_base, sm_scale, top_k, window, False)
        torch.testing.assert_close(out, torch.stack(want), **TOL)
        assert_top_k(pos, ranks, n_base, top_k)
        for follow in (False, True):
            real, probs = oracle.output_rows(q[:B], contexts, sm_scale, window=window)
            spec, pos = oracle.speculative_rows(q[B:], k_own, v_own, contexts, n_base, sm_scale, top_k,
                                                probs if follow else None, window=window)
            want_real, want_spec, ranks = visible_lanes(q[:B], q[B:], k_own, v_own, contexts, n_base, sm_scale,
                                                        top_k, window, follow)
            torch.testing.assert_close(real, torch.stack(want_real), **TOL)
            torch.testing.assert_close(spec, torch.stack(want_spec), **TOL)
            assert_top_k(pos, ranks, n_base, top_k)


def test_window_zero_reads_the_rows_own_key_only():
    """W = 0: the output row's output is its own position's value (a prefetched 16-bit row where one replaces it),
    the speculative row's its own value, and nothing is chosen."""
    G, H, D, VG = SHAPES[0]
    kv, plan, n_base, q, k_own, v_own, (tk, tv, tpos) = case(G, H, D, VG, 1, 1, 4, seed=9)
    B = len(n_base)
    ctx = padded.prepare(plan, G, H)
    out, pos = lanes.two_lane(q, k_own, v_own, kv, ctx, D ** -0.5, 4, tk, tv, tpos, True, window=0)
    contexts = oracle.with_topk([gather_context(kv, plan, b) for b in range(B)], n_base, tk, tv, tpos)
    for b in range(B):
        torch.testing.assert_close(out[b], contexts[b][1][-1], rtol=0, atol=1e-6)
        torch.testing.assert_close(out[B + b], v_own[b], rtol=0, atol=1e-6)
    assert (pos == -1).all()


@pytest.mark.parametrize("bits", [1, 2])
@pytest.mark.parametrize("shape", range(len(SHAPES)))
def test_batched_lanes_match_the_oracle_under_windows(shape, bits):
    G, H, D, VG = SHAPES[shape]
    group, top_k = 1 + (shape + bits) % 3, [3, 9, 2 * G + 1][shape]
    kv, plan, n_base, q, k_own, v_own, (tk, tv, tpos) = case(G, H, D, VG, bits, group, top_k, seed=10 * shape + bits)
    B, sm_scale = len(n_base), D ** -0.5
    ctx = padded.prepare(plan, G, H)
    stored = [gather_context(kv, plan, b) for b in range(B)]
    contexts = oracle.with_topk(stored, n_base, tk, tv, tpos)
    for window in windows(G):
        out, pos = lanes.predecode(q[:B], k_own, v_own, kv, ctx, sm_scale, top_k, window=window)
        want, _ = oracle.speculative_rows(q[:B], k_own, v_own, stored, n_base, sm_scale, top_k, window=window)
        _, _, ranks = visible_lanes(None, q[:B], k_own, v_own, stored, n_base, sm_scale, top_k, window, False)
        assert not out.isnan().any(), "a position past a context's end (NaN in the pool) reached the output"
        torch.testing.assert_close(out, want, **TOL)
        assert_top_k(pos, ranks, n_base, top_k)
        real, probs = oracle.output_rows(q[:B], contexts, sm_scale, window=window)
        for follow in (False, True):
            spec, _ = oracle.speculative_rows(q[B:], k_own, v_own, contexts, n_base, sm_scale, top_k,
                                              probs if follow else None, window=window)
            out, pos = lanes.two_lane(q, k_own, v_own, kv, ctx, sm_scale, top_k, tk, tv, tpos, follow,
                                      padded.Workspace(), window=window)
            assert not out.isnan().any()
            torch.testing.assert_close(out, torch.cat([real, spec]), **TOL, msg=lambda m: f"W={window}: {m}")
            _, _, ranks = visible_lanes(q[:B], q[B:], k_own, v_own, contexts, n_base, sm_scale, top_k, window,
                                        follow)
            assert_top_k(pos, ranks, n_base, top_k)


def test_a_window_wider_than_every_context_is_no_window_to_the_bit():
    G, H, D, VG = SHAPES[1]
    kv, plan, n_base, q, k_own, v_own, (tk, tv, tpos) = case(G, H, D, VG, 2, 3, 7, seed=4)
    ctx = padded.prepare(plan, G, H)
    for follow in (False, True):
        full = lanes.two_lane(q, k_own, v_own, kv, ctx, D ** -0.5, 7, tk, tv, tpos, follow)
        wide = lanes.two_lane(q, k_own, v_own, kv, ctx, D ** -0.5, 7, tk, tv, tpos, follow, window=10 * G)
        assert torch.equal(wide[0], full[0]) and torch.equal(wide[1], full[1])
    narrow = lanes.two_lane(q, k_own, v_own, kv, ctx, D ** -0.5, 7, tk, tv, tpos, True, window=G)
    assert (narrow[0] - full[0]).abs().max() > 1e-3 and not torch.equal(narrow[1], full[1])


@pytest.mark.parametrize("window", [0, 5, 8, 12, 30, 100])
def test_extend_reads_the_16_bit_prefix_within_the_window(window):
    """SpeCache's extend (attention_extend with the host tier's rows as the prefix, what kvq_torch runs) against
    attention over the true prefix and new tokens under window_mask, and ref_extend with the same contexts."""
    G, H, D, VG = SHAPES[0]
    gen = torch.Generator().manual_seed(window)
    prefix, new = [29, 0, 16, 7], [11, 9, 1, 20]
    qo = torch.tensor([0, *new]).cumsum(0)
    N = int(qo[-1])
    q, k, v = (torch.randn(N, h, D, generator=gen) for h in (2 * H, H, H))
    contexts = [(torch.randn(p, H, D, generator=gen), torch.randn(p, H, D, generator=gen)) for p in prefix]
    kv, plan = make_pool(G, H, D, VG, 2, [(0, 1)] * len(prefix), torch.float32, seed=1)  # its pages are not read
    out = attention_extend.extend(q, k, v, qo, kv, plan, D ** -0.5, contexts=contexts, window=window)
    torch.testing.assert_close(out, ref_extend(q, k, v, qo, kv, plan, D ** -0.5, contexts=contexts, window=window),
                               **TOL)
    for b, p in enumerate(prefix):
        lo, hi = int(qo[b]), int(qo[b + 1])
        mask = window_mask(hi - lo, p, window, torch.device("cpu"))
        want = _attend(q[lo:hi], torch.cat([contexts[b][0], k[lo:hi]]), torch.cat([contexts[b][1], v[lo:hi]]),
                       D ** -0.5, mask)
        torch.testing.assert_close(out[lo:hi], want, **TOL)


# ---- the backend, driven as SGLang drives it (tests/unit/test_specache_lanes.py's harness) ----

def windowed_layers(window):
    from test_specache_lanes import LAYER

    return [type(layer)(**{**vars(layer), "sliding_window_size": window}) for layer in LAYER]


@pytest.mark.parametrize("window", [0, 6, 13])
def test_backend_extends_and_decodes_within_the_window(window):
    """A request of 37 tokens extended as 29 + 8 on a windowed layer, then its pre-decode and a two-lane step: every
    output equals attention over the visible exact K/V (the extend's prefix is the host tier's 16-bit rows; decode
    reads the pool with the prefetched rows), and every prefetched position lies in the next output row's window."""
    pytest.importorskip("sglang")
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from test_specache_lanes import HQ, K, L, SCALE, G as PG, Seq, decode_batch, make

    from sgl_kvq.specache.state import Lanes

    layers = windowed_layers(window)
    backend, pool, r2t = make()
    sc, H = pool.strategy_state, pool.store.shape.heads
    s = Seq(1, 1, 37, r2t, torch.Generator().manual_seed(window))
    for lo, hi in ((0, 29), (29, 37)):
        fb = SimpleNamespace(forward_mode=ForwardMode.EXTEND, req_pool_indices=torch.tensor([s.r]),
                             seq_lens=torch.tensor([hi]), out_cache_loc=torch.arange(lo, hi) + s.first,
                             extend_prefix_lens_cpu=[lo], extend_seq_lens_cpu=[hi - lo])
        backend.init_forward_metadata(fb)
        for li in range(L):
            out = backend.forward_extend(s.q[lo:hi].reshape(hi - lo, -1), s.k[li][lo:hi].reshape(hi - lo, -1),
                                         s.v[li][lo:hi].reshape(hi - lo, -1), layers[li], fb).view(-1, HQ, 16)
            want = _attend(s.q[lo:hi], s.k[li][:hi], s.v[li][:hi], SCALE, window_mask(hi - lo, lo, window, "cpu"))
            torch.testing.assert_close(out, want, **TOL)

    # pre-decode of the token at position 37 (read-only, own key at 37): sees 37 - W .. 37, prefetches there
    sc.lanes = Lanes("predecode", 1, torch.tensor([0]))
    fb = decode_batch([s], sc.lanes)
    backend.init_forward_metadata(fb)
    n = s.n
    for li in range(L):
        out = backend.forward_decode(s.q[n:n + 1].reshape(1, -1), s.k[li][n:n + 1].reshape(1, -1),
                                     s.v[li][n:n + 1].reshape(1, -1), layers[li], fb).view(1, HQ, 16)
        ctx_k, ctx_v = gather_context(pool.store.layer_view(li), backend.forward_plan.steps[0].plan, 0)
        first = visible_from(n, window)
        keys, vals = torch.cat([ctx_k, s.k[li][n:n + 1]])[first:], torch.cat([ctx_v, s.v[li][n:n + 1]])[first:]
        torch.testing.assert_close(out[0], _attend(s.q[n:n + 1], keys, vals, SCALE)[0], **TOL)
        pos = sc.topk.positions(li, torch.tensor([s.r]))
        assert bool((pos[pos >= 0] >= first).all()), pos
        assert (pos >= 0).sum() == H * min(K, max(backend.forward_plan.steps[0].plan.base_len(0, PG) - first, 0))

    # a two-lane step: the real row at 37 (written) sees 37 - W .. 37 with the prefetched rows exact; the
    # speculative row at 38 sees 38 - W .. 38; the next top-k lies in 38 - W .. (the next output row's window)
    sc.lanes = Lanes("two_lane", 1)
    fb = decode_batch([s], sc.lanes)
    backend.init_forward_metadata(fb)
    plan = backend.forward_plan.steps[0].plan
    for li in range(L):
        prev_k, prev_v, prev_pos = (t[0] for t in sc.topk.rows(li, torch.tensor([s.r])))
        q = torch.stack([s.q[n], s.spec_q[n + 1]])
        k = torch.stack([s.k[li][n], s.spec_k[li][n + 1]])
        v = torch.stack([s.v[li][n], s.spec_k[li][n + 1]])
        out = backend.forward_decode(q.reshape(2, -1), k.reshape(2, -1), v.reshape(2, -1), layers[li],
                                     fb).view(2, HQ, 16)
        ctx_k, ctx_v = gather_context(pool.store.layer_view(li), plan, 0)
        n_base = plan.base_len(0, PG)
        for h in range(H):
            p = prev_pos[h]
            p = p[(p >= 0) & (p < n_base)]
            ctx_k[p, h], ctx_v[p, h] = s.k[li][p, h], s.v[li][p, h]
        fr, fs = visible_from(n, window), visible_from(n + 1, window)
        torch.testing.assert_close(out[0], _attend(q[:1], ctx_k[fr:], ctx_v[fr:], SCALE)[0], **TOL)
        torch.testing.assert_close(out[1], _attend(q[1:], torch.cat([ctx_k, k[1:]])[fs:],
                                                   torch.cat([ctx_v, v[1:]])[fs:], SCALE)[0], **TOL)
        pos = sc.topk.positions(li, torch.tensor([s.r]))
        assert bool((pos[pos >= 0] >= fs).all()), pos
        assert (pos >= 0).sum() == H * min(K, max(n_base - fs, 0))
