"""SpeCache's two-lane decode on kvq_triton's device-built metadata against the torch lanes on the host-built one,
at every step of a random request life (tests/unit/test_decode_metadata.py's Life: pages allocated, completed, freed,
reused; slots reused; radix-shared prefixes).

Both lanes of a request read one plan entry (kernels/specache_decode.py: rows are lane-major over the n real
requests), so the doubled rows need no metadata of their own: build_decode over the real rows plans both. Checked
per step: the same pages and frames per request, the same pool after the write (real rows only), the same output
and speculative rows, and the same next top-k positions, which then feed the next step's prefetched rows.
"""

from __future__ import annotations

import pytest
import torch

from sgl_kvq.attention_ref import gather_context
from sgl_kvq.config import KVQConfig
from sgl_kvq.kernels import specache_decode as sd
from sgl_kvq.kv_store import QuantizedKVStore
from sgl_kvq.metadata.device import DecodeBuffers, build_decode
from sgl_kvq.metadata.forward import build_forward_plan
from sgl_kvq.pool_shape import PoolShape
from sgl_kvq.specache.attention import output_rows, speculative_rows, with_topk
from sgl_kvq.formats.specache import SpeCacheParams
from test_decode_metadata import DEVICE, MAX_CTX, NUM_PAGES, SLOTS, Life, assert_same_pool, per_request
from slices import ci_slice

H, HQ, D, SCALE = 2, 6, 16, 0.25  # GQA 3


def make_store(G, bits, residual, top_k, follow):
    cfg = KVQConfig("specache", bits, group_size=G, value_group=16, residual=residual,
                    params=SpeCacheParams(top_k=top_k, follow=int(follow)))
    return QuantizedKVStore(cfg, PoolShape(1, H, D, NUM_PAGES, cfg), SLOTS, torch.float32, DEVICE)


# CI: one walk (a window, 1 bit, follow on); KVQ_TEST_MATRIX=all adds 2 bit without a window and G = 32 (40-75 s
# each under the interpreter)
@pytest.mark.parametrize("G,bits,residual,top_k,follow", ci_slice(
    [(16, 1, 16, 6, True), (16, 2, 0, 40, False), (32, 1, 0, 9, True)], [(16, 1, 16, 6, True)]))
def test_two_lanes_on_device_metadata_match_the_host_path(G, bits, residual, top_k, follow, triton_interpret):
    torch.manual_seed(G + bits + top_k)
    host, dev = make_store(G, bits, residual, top_k, follow), make_store(G, bits, residual, top_k, follow)
    life = Life(G, seed=G * 7 + bits + top_k)
    bufs = DecodeBuffers(SLOTS, MAX_CTX // G, host.ring, torch.device(DEVICE))
    tk = torch.zeros(SLOTS, H, top_k, D, device=DEVICE)
    tv = torch.zeros_like(tk)
    tpos = torch.full((SLOTS, H, top_k), -1, dtype=torch.int64, device=DEVICE)
    steps = replaced = 0
    for _ in range(80 if triton_interpret else 300):
        if life.free_slots and (not life.active or life.rng.random() < 0.08):
            life.start()
        if life.rng.random() < 0.1 and (done := life.pick_finisher()) is not None:
            life.finish(done)
            tpos[done] = -1  # a reused slot starts with nothing prefetched (SpeCacheState.reset_requests)
            continue
        if not life.active:
            continue
        req, lens, locs = life.decode_batch()
        n = len(req)
        if not n:
            continue
        q = torch.randn(2 * n, HQ, D, device=DEVICE)
        k, v = torch.randn(2 * n, H, D, device=DEVICE), torch.randn(2 * n, H, D, device=DEVICE)

        ref = build_forward_plan(host, life.req_to_token, req, lens, locs, is_decode=True).steps[0]
        host.write_layer(0, ref.write, k[:n], v[:n])
        base = [ref.plan.base_len(b, G) for b in range(n)]
        ctx = [gather_context(host.layer_view(0), ref.plan, b) for b in range(n)]
        ctx = with_topk(ctx, base, tk[req], tv[req], tpos[req])
        real, real_probs = output_rows(q[:n], ctx, SCALE)
        spec, want_pos = speculative_rows(q[n:], k[n:], v[n:], ctx, base, SCALE, top_k,
                                          real_probs if follow else None)
        want = torch.cat([real, spec])

        write, plan = build_decode(dev, life.req_to_token, req, lens, locs, bufs)
        dev.write_decode_layer(0, write, k[:n], v[:n])
        p = sd.plan(plan, n_lanes=2, num_qo_heads=HQ, num_kv_heads=H, head_dim=D, page_size=G)
        scores = torch.empty((2 if follow else 1) * n, HQ, MAX_CTX, device=DEVICE)
        got, lse = sd.specache_decode(q, k[n:], v[n:], dev.layer_view(0), p, sd.TopK.per_slot(tk, tv, tpos, req),
                                      SCALE, scores, follow=follow)
        got_pos = sd.select_topk(scores[-n:], lse[n:], p.base_tokens, H, top_k,
                                 follow=(scores[:n], lse[:n]) if follow else None)

        for b in range(n):
            assert per_request(plan, b) == per_request(ref.plan, b), (steps, b)
        assert_same_pool(host, dev)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(got_pos.sort(-1).values, want_pos.sort(-1).values), steps
        replaced += int(((tpos[req] >= 0) & (tpos[req] < torch.tensor(base, device=DEVICE)[:, None, None])).sum())
        # the next step's prefetch: the selected positions' rows, here fresh rows unlike the codes' reading
        tpos[req] = got_pos
        tk[req], tv[req] = torch.randn(n, H, top_k, D, device=DEVICE), torch.randn(n, H, top_k, D, device=DEVICE)
        steps += 1
    assert steps > 30 and replaced > 0 and life.shared > 0
