"""SpeCache's backend (sgl_kvq/backends/specache_backend.py) on CPU, driven the way SGLang drives it, checked
against exact K/V computed independently:

- an extend reads its cached prefix in 16 bits from the host tier (exact attention over the true prefix);
- a two-lane decode step writes only the real rows (the pool equals a twin written with the real rows alone);
  the real rows attend to the packed base with the prefetched positions replaced by their exact 16-bit rows;
  the speculative rows attend to the same keys plus their own K/V, and their top-k (attention mass summed over
  each KV head's query heads, plus the real row's one position earlier: specache_follow) is what gets
  prefetched, with the exact rows;
- the pre-decode step writes nothing and prefetches for the requests it covers;
- run_lanes (sgl_kvq/specache/lanes.py) builds the rows of each forward from the batch and hands back the real
  rows' logits, with the batch restored;
- the scheduler hook exports KVQTokenToKVPool.stats for a kvq pool and the basic keys for a bf16 one.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")

from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from sgl_kvq.attention_ref import _attend, gather_context  # noqa: E402
from sgl_kvq.backends.specache_backend import KVQSpeCacheBackend  # noqa: E402
from sgl_kvq.config import KVQConfig  # noqa: E402
from sgl_kvq.pool import KVQTokenToKVPool  # noqa: E402
from sgl_kvq.pool_shape import PoolShape
from sgl_kvq.specache.attention import top_positions  # noqa: E402
from sgl_kvq.specache.lanes import run_lanes  # noqa: E402
from sgl_kvq.specache.state import Lanes  # noqa: E402
from sgl_kvq.formats.specache import SpeCacheParams

G, H, HQ, D, L, K = 8, 2, 4, 16, 2, 5
SCALE = D ** -0.5
LAYER = [SimpleNamespace(layer_id=i, tp_q_head_num=HQ, tp_k_head_num=H, tp_v_head_num=H, qk_head_dim=D,
                         v_head_dim=D, scaling=SCALE, is_cross_attention=False, sliding_window_size=None,
                         logit_cap=0) for i in range(L)]


def make(bits=2, prefix="host", recall=0):
    cfg = KVQConfig("specache", bits, group_size=G, value_group=8, residual=G,
                    params=SpeCacheParams(top_k=K, prefix=prefix, recall=recall))
    pool = KVQTokenToKVPool(32 * G, PoolShape(L, H, D, 32, cfg), "cpu", torch.float32, num_req_slots=4)
    r2t = torch.zeros(4, 512, dtype=torch.int32)
    runner = SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=r2t))
    return KVQSpeCacheBackend(runner), pool, r2t


class Seq:
    """A request in slot r whose position p has true K/V kv[layer][p] and sits in pool slot (first_page*G + p)."""

    def __init__(self, r, first_page, n, r2t, gen):
        self.r, self.n = r, n
        r2t[r, :512] = torch.arange(512, dtype=torch.int32) + first_page * G
        self.k = [torch.randn(512, H, D, generator=gen) for _ in range(L)]
        self.v = [torch.randn(512, H, D, generator=gen) for _ in range(L)]
        self.q = torch.randn(512, HQ, D, generator=gen)
        self.spec_q = torch.randn(512, HQ, D, generator=gen)
        self.spec_k = [torch.randn(512, H, D, generator=gen) for _ in range(L)]
        self.first = first_page * G


def extend(backend, seqs, prefix, new):
    fb = SimpleNamespace(forward_mode=ForwardMode.EXTEND, req_pool_indices=torch.tensor([s.r for s in seqs]),
                         seq_lens=torch.tensor([p + n for p, n in zip(prefix, new)]),
                         out_cache_loc=torch.cat([torch.arange(p, p + n) + s.first
                                                  for s, p, n in zip(seqs, prefix, new)]),
                         extend_prefix_lens_cpu=list(prefix), extend_seq_lens_cpu=list(new))
    backend.init_forward_metadata(fb)
    outs = []
    for li in range(L):
        q = torch.cat([s.q[p:p + n] for s, p, n in zip(seqs, prefix, new)])
        k = torch.cat([s.k[li][p:p + n] for s, p, n in zip(seqs, prefix, new)])
        v = torch.cat([s.v[li][p:p + n] for s, p, n in zip(seqs, prefix, new)])
        outs.append(backend.forward_extend(q.reshape(len(q), -1), k.reshape(len(k), -1), v.reshape(len(v), -1),
                                           LAYER[li], fb).view(-1, HQ, D))
    return outs


def decode_batch(seqs, lanes):
    B = len(seqs)
    lens = torch.tensor([s.n + 1 for s in seqs])
    loc = torch.tensor([s.first + s.n for s in seqs])
    if lanes.kind == "two_lane":
        loc = torch.cat([loc, torch.zeros(B, dtype=torch.int64)])
    return SimpleNamespace(forward_mode=ForwardMode.DECODE, req_pool_indices=torch.tensor([s.r for s in seqs]),
                           seq_lens=lens, out_cache_loc=loc)


def pool_state(pool):
    s = pool.store
    return [t.clone() for t in (s.k_codes, s.k_scale, s.k_zero, s.v_codes, s.v_scale, s.v_zero, s.ov_k, s.ov_v,
                                s.ov_tag, s.ov_gen, s.page_gen, pool.strategy_state.host.hk,
                                pool.strategy_state.host.hv)]


def test_extend_reads_the_cached_prefix_in_16_bits_from_the_host_tier():
    backend, pool, r2t = make()
    a = Seq(1, 1, 40, r2t, torch.Generator().manual_seed(0))
    extend(backend, [a], [0], [29])
    out = extend(backend, [a], [29], [11])  # a continuation: positions 0..28 come from the cache
    for li in range(L):
        mask = torch.ones(11, 40, dtype=torch.bool)
        mask[:, 29:] = torch.ones(11, 11, dtype=torch.bool).tril()
        want = _attend(a.q[29:40], a.k[li][:40], a.v[li][:40], SCALE, mask)
        torch.testing.assert_close(out[li], want, atol=1e-5, rtol=1e-5)
    sc = pool.strategy_state
    assert sc.needs_predecode[1] and all((sc.topk.positions(li, torch.tensor([1])) == -1).all() for li in range(L))


def test_device_prefix_mode_reads_the_cached_prefix_from_the_low_bit_pool():
    """KVQ_SPECACHE_PREFIX=device: the continuation attends to the prefix as the pool stores it (packed base +
    fp16 frames, exactly kivi's extend), not to the host tier's 16-bit rows; the host tier is still written."""
    backend, pool, r2t = make(prefix="device")
    a = Seq(1, 1, 40, r2t, torch.Generator().manual_seed(0))
    extend(backend, [a], [0], [29])
    fb = SimpleNamespace(forward_mode=ForwardMode.EXTEND, req_pool_indices=torch.tensor([1]),
                         seq_lens=torch.tensor([40]), out_cache_loc=torch.arange(29, 40) + a.first,
                         extend_prefix_lens_cpu=[29], extend_seq_lens_cpu=[11])
    backend.init_forward_metadata(fb)
    plan = backend.forward_plan.steps[0].plan
    mask = torch.ones(11, 40, dtype=torch.bool)
    mask[:, 29:] = torch.ones(11, 11, dtype=torch.bool).tril()
    for li in range(L):
        kp, vp = gather_context(pool.store.layer_view(li), plan, 0)  # before this layer's write
        assert not torch.allclose(kp, a.k[li][:29], atol=1e-3)  # the stored prefix is quantized beyond the window
        out = backend.forward_extend(a.q[29:40].reshape(11, -1), a.k[li][29:40].reshape(11, -1),
                                     a.v[li][29:40].reshape(11, -1), LAYER[li], fb).view(-1, HQ, D)
        want = _attend(a.q[29:40], torch.cat([kp, a.k[li][29:40]]), torch.cat([vp, a.v[li][29:40]]), SCALE, mask)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(pool.strategy_state.host.rows(li, torch.arange(40) + a.first)[0], a.k[li][:40])


@pytest.mark.parametrize("bits", [1, 2])
def test_two_lane_step_writes_real_rows_only_and_prefetches_the_speculative_top_k(bits):
    gen = torch.Generator().manual_seed(bits)
    backend, pool, r2t = make(bits, recall=1)  # KVQ_SPECACHE_RECALL=1
    twin, twin_pool, twin_r2t = make(bits, recall=1)
    seqs = [Seq(1, 1, 37, r2t, gen), Seq(3, 12, 19, r2t, gen)]
    twin_gen = torch.Generator().manual_seed(bits)
    twin_seqs = [Seq(1, 1, 37, twin_r2t, twin_gen), Seq(3, 12, 19, twin_r2t, twin_gen)]
    for be, ss in ((backend, seqs), (twin, twin_seqs)):
        extend(be, ss, [0, 0], [s.n for s in ss])
    sc = pool.strategy_state

    # pre-decode: read-only, prefetches for the requests it covers
    before = pool_state(pool)
    sc.lanes = Lanes("predecode", 1, torch.tensor([1]))
    fb = decode_batch(seqs, sc.lanes)
    backend.init_forward_metadata(fb)
    s = seqs[1]
    for li in range(L):
        backend.forward_decode(s.q[s.n:s.n + 1].reshape(1, -1), s.k[li][s.n:s.n + 1].reshape(1, -1),
                               s.v[li][s.n:s.n + 1].reshape(1, -1), LAYER[li], fb)
    assert all(torch.equal(x, y) for x, y in zip(before, pool_state(pool)))
    assert all((sc.topk.positions(li, torch.tensor([3])) >= 0).any() for li in range(L))
    assert all((sc.topk.positions(li, torch.tensor([1])) == -1).all() for li in range(L))

    # two lanes: rows 0..B-1 real (positions n), rows B..2B-1 speculative (positions n + 1)
    prev = [[sc.topk.rows(li, torch.tensor([s.r])) for s in seqs] for li in range(L)]  # copies
    sc.lanes = Lanes("two_lane", 2)
    fb = decode_batch(seqs, sc.lanes)
    backend.init_forward_metadata(fb)
    plan = backend.forward_plan.steps[0].plan
    for li in range(L):
        q = torch.cat([torch.stack([s.q[s.n] for s in seqs]), torch.stack([s.spec_q[s.n + 1] for s in seqs])])
        k = torch.cat([torch.stack([s.k[li][s.n] for s in seqs]), torch.stack([s.spec_k[li][s.n + 1] for s in seqs])])
        v = torch.cat([torch.stack([s.v[li][s.n] for s in seqs]), torch.stack([s.spec_k[li][s.n + 1] for s in seqs])])
        out = backend.forward_decode(q.reshape(4, -1), k.reshape(4, -1), v.reshape(4, -1), LAYER[li], fb).view(4, HQ, D)
        kv = pool.store.layer_view(li)
        for b, s in enumerate(seqs):
            ctx_k, ctx_v = gather_context(kv, plan, b)
            n_base = plan.base_len(b, G)
            # real row: the base with last step's prefetched positions replaced by their exact rows
            rk, rv = ctx_k.clone(), ctx_v.clone()
            prev_k, _, prev_pos = prev[li][b]
            for h in range(H):
                p = prev_pos[0, h]
                p = p[(p >= 0) & (p < n_base)]
                rk[p, h], rv[p, h] = s.k[li][p, h], s.v[li][p, h]
                if len(p):
                    assert torch.equal(prev_k[0, h, :len(p)], s.k[li][p, h])
            torch.testing.assert_close(out[b], _attend(q[b:b + 1], rk, rv, SCALE)[0], atol=1e-5, rtol=1e-5)
            # speculative row: the same keys as the output row (Algorithm 3) plus its own K/V; its top-k is this
            # layer's prefetch
            sk, sv = torch.cat([rk, k[2 + b:3 + b]]), torch.cat([rv, v[2 + b:3 + b]])
            torch.testing.assert_close(out[2 + b], _attend(q[2 + b:3 + b], sk, sv, SCALE)[0], atol=1e-5, rtol=1e-5)
            group = HQ // H
            scores = torch.einsum("hd,thd->ht", q[2 + b], sk.repeat_interleave(group, 1)) * SCALE
            real = torch.einsum("hd,thd->ht", q[b], rk.repeat_interleave(group, 1)) * SCALE
            want = top_positions(torch.softmax(scores, -1), H, n_base, K,
                                 follow=torch.softmax(real, -1) if pool.store.cfg.params.follow else None)
            got_k, got_v, got = (t[0] for t in sc.topk.rows(li, torch.tensor([s.r])))
            assert [set(x.tolist()) for x in got] == [set(x.tolist()) for x in want]
            for h in range(H):
                p = got[h][got[h] >= 0]
                assert torch.equal(got_k[h, :len(p)], s.k[li][p, h])
                assert torch.equal(got_v[h, :len(p)], s.v[li][p, h])
    for s in seqs:
        s.n += 1

    # the twin decodes the same real tokens as a one-lane step: both pools must be identical
    twin.sc.lanes = Lanes("two_lane", 2)
    fb = decode_batch(twin_seqs, twin.sc.lanes)
    twin.init_forward_metadata(fb)
    for li in range(L):
        q = torch.stack([s.q[s.n] for s in twin_seqs] * 2)
        k = torch.stack([s.k[li][s.n] for s in twin_seqs] + [s.k[li][s.n] * 0 for s in twin_seqs])
        v = torch.stack([s.v[li][s.n] for s in twin_seqs] * 2)
        twin.forward_decode(q.reshape(4, -1), k.reshape(4, -1), v.reshape(4, -1), LAYER[li], fb)
    mine, theirs = pool_state(pool), pool_state(twin_pool)
    assert all(torch.equal(x, y) for x, y in zip(mine, theirs)), "a speculative row reached the pool"
    assert sc.recall_wanted > 0 and 0 <= sc.recall_hits <= sc.recall_wanted


def test_run_lanes_predecodes_new_requests_then_doubles_the_rows():
    _, pool, _ = make()
    sc = pool.strategy_state
    ids, pos, loc = torch.tensor([5, 6]), torch.tensor([37, 19]), torch.tensor([45, 115])
    fb = SimpleNamespace(input_ids=ids, positions=pos, out_cache_loc=loc, req_pool_indices=torch.tensor([1, 3]))
    seen = []

    def forward(next_tokens):
        seen.append((sc.lanes, fb.input_ids.clone(), fb.positions.clone(), fb.out_cache_loc.clone()))
        return SimpleNamespace(next_token_logits=torch.nn.functional.one_hot(torch.tensor(next_tokens), 20).float(),
                               hidden_states=None)

    outs = iter([[7, 9], [1, 2, 11, 12]])
    out = run_lanes(lambda: forward(next(outs)), fb, sc)
    (pre, pre_ids, pre_pos, pre_loc), (two, two_ids, two_pos, two_loc) = seen
    assert pre.kind == "predecode" and pre.rows.tolist() == [0, 1] and pre_loc.tolist() == [0, 0]
    assert pre_ids.tolist() == [5, 6] and pre_pos.tolist() == [37, 19]
    assert two.kind == "two_lane" and two.n_real == 2
    assert two_ids.tolist() == [5, 6, 7, 9] and two_pos.tolist() == [37, 19, 38, 20]
    assert two_loc.tolist() == [45, 115, 0, 0]
    assert out.next_token_logits.argmax(-1).tolist() == [1, 2]
    assert fb.input_ids is ids and fb.positions is pos and fb.out_cache_loc is loc and sc.lanes is None
    assert sc.spec_token[[1, 3]].tolist() == [11, 12] and sc.spec_input[[1, 3]].tolist() == [7, 9]
    assert sc.predecode_rows == 2 and sc.decode_steps == 1 and not any(sc.needs_predecode[r] for r in (1, 3))

    # next step: no pre-decode; last step's guesses 7, 9 against the real tokens 7, 8
    seen.clear()
    fb.input_ids = torch.tensor([7, 8])
    outs = iter([[3, 4, 13, 14]])
    run_lanes(lambda: forward(next(outs)), fb, sc)
    assert len(seen) == 1 and seen[0][1].tolist() == [7, 8, 11, 12]
    assert int(sc.spec_guesses) == 2 and int(sc.spec_hits) == 1 and sc.decode_steps == 2


def test_the_scheduler_hook_exports_the_pool_stats_of_a_specache_pool_and_a_bf16_pool():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from fake_scheduler import fake_scheduler
    from sgl_kvq.patches.observability import add_kv_pool_stats

    def exported(pool, capacity):
        scheduler = fake_scheduler(pool, capacity, max_running_requests=7, free_slots=5)
        state = {}
        assert add_kv_pool_stats("result", SimpleNamespace(scheduler=scheduler), state) == "result"
        live = state["kv_pool"].pop("live")
        assert live["free_tokens"] == capacity - 3 and live["evictable_tokens"] == 2
        assert live["protected_tokens"] == 1 and live["free_req_slots"] == 5
        assert live["running_requests"] == 1 and live["waiting_requests"] == 0
        # no page has been written: no overlay frame is tagged with a page, so none is live
        assert live.get("overlay_frames_live", 0) == 0
        return state["kv_pool"]

    basic = {"pool_class", "capacity_tokens", "kv_bytes", "kv_bytes_per_token", "page_size", "kv_budget_bytes",
             "max_running_requests"}
    bf16 = exported(MHATokenToKVPool(64, 1, torch.bfloat16, H, D, L, "cpu", False), 64)
    assert set(bf16) == basic and bf16["pool_class"] == "MHATokenToKVPool" and bf16["page_size"] == 1
    assert bf16["kv_bytes"] == bf16["kv_bytes_per_token"] * 64 > 0

    _, pool, _ = make()
    s = exported(pool, 32 * G)
    assert set(s) == basic | {"kv_cache_dtype", "base_bytes", "overlay_bytes", "request_state_bytes",
                              "base_bytes_per_token", "layer_base_bytes_per_token", "config", "specache",
                              "host_bytes", "host_bytes_per_token", "frames_pooled", "frames_held", "frame_tokens",
                              "pages_quantized"}
    assert sum(s["layer_base_bytes_per_token"]) == s["base_bytes_per_token"]
    assert s["request_state_bytes"] == s["overlay_bytes"] + pool.strategy_state.device_bytes()
    assert s["max_running_requests"] == 7
    k, v = pool.get_kv_size_bytes()
    assert s["kv_bytes"] == k + v and s["page_size"] == G and s["kv_cache_dtype"] == pool.cfg.name
    assert s["host_bytes"] == pool.strategy_state.host.nbytes() == s["host_bytes_per_token"] * 32 * G
    assert s["specache"]["top_k"] == K and s["config"]["group_size"] == G


def test_specache_defaults_and_follow_knob(monkeypatch):
    """specache1 reads top-128 by default, specache2 top-64 (KVQ_TOPK overrides both); the follow ranking is on by
    default, KVQ_SPECACHE_FOLLOW=0 gives the paper's, and anything else is refused before load."""
    from sgl_kvq.config import KVQConfigError, parse_kv_cache_dtype

    for var in ("KVQ_TOPK", "KVQ_SPECACHE_FOLLOW"):
        monkeypatch.delenv(var, raising=False)
    assert (parse_kv_cache_dtype("specache1").params.top_k, parse_kv_cache_dtype("specache2").params.top_k) == (128, 64)
    assert parse_kv_cache_dtype("specache1").params.follow == 1
    monkeypatch.setenv("KVQ_TOPK", "32")
    monkeypatch.setenv("KVQ_SPECACHE_FOLLOW", "0")
    assert parse_kv_cache_dtype("specache1").params.top_k == 32 and parse_kv_cache_dtype("specache2").params.follow == 0
    monkeypatch.setenv("KVQ_SPECACHE_FOLLOW", "2")
    with pytest.raises(KVQConfigError, match="KVQ_SPECACHE_FOLLOW=2 must be 0 or 1"):
        parse_kv_cache_dtype("specache2")


def test_top_positions_follow_adds_the_real_rows_mass_one_later():
    spec = torch.tensor([[0.30, 0.20, 0.10, 0.05, 0.35], [0.30, 0.20, 0.10, 0.05, 0.35]])  # 2 query heads, 1 KV head
    real = torch.tensor([[0.00, 0.10, 0.60, 0.00, 0.30], [0.00, 0.00, 0.50, 0.20, 0.30]])
    assert top_positions(spec, 1, 4, 1).tolist() == [[0]]  # position 4 is past the base
    assert top_positions(spec, 1, 4, 1, follow=real).tolist() == [[3]]  # 0.10 + (0.60 + 0.50)
    assert top_positions(spec, 1, 4, 2, follow=real).tolist() == [[3, 0]]
    assert top_positions(spec, 1, 1, 3, follow=real).tolist() == [[0, -1, -1]]  # one base row: nothing follows
