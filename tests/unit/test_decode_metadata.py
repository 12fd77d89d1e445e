"""kvq_triton's device-side decode metadata (sgl_kvq/metadata/device.py) and its CUDA-graph protocol.

The oracle is the host path kvq_torch uses (metadata.host.begin_batch + plan_contexts, write_layer): two stores walk the
same random life of requests (pages allocated, completed, freed, reused; request slots reused; prefixes shared as
the radix tree shares them), one through each path, and after every decode step they must hold the same pool
state, plan the same pages and frames, and attend to the same result.

On CPU a CUDA graph cannot be captured; what the graph relies on is checked instead: one set of buffers serves
every replay (addresses never change), padded rows (SGLang pads with request slot 0, out_cache_loc 0, seq_len 1)
leave every real request's state and output untouched. On CUDA the capture/replay itself runs too.
"""

from __future__ import annotations

import random

import pytest
import torch

from slices import ci_slice
from sgl_kvq import attention_ref
from sgl_kvq.config import KVQConfig
from sgl_kvq.kernels import decode_attention as dec
from sgl_kvq.kv_store import QuantizedKVStore
from sgl_kvq.layout import frame_of
from sgl_kvq.metadata.device import DecodeBuffers, build_decode
from sgl_kvq.metadata.forward import build_forward_plan
from sgl_kvq.plan import PagedPlan
from sgl_kvq.pool_shape import PoolShape

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, HQ, D = 2, 4, 16
NUM_PAGES, SLOTS, MAX_CTX = 24, 5, 256  # request slots 0..4, slot 0 reserved as in SGLang's ReqToTokenPool
SCALE = 0.25


def make_store(G, bits, residual, dtype=torch.float32, method="kivi"):
    cfg = KVQConfig(method, bits, group_size=G, value_group=16, residual=residual)
    return QuantizedKVStore(cfg, PoolShape(1, H, D, NUM_PAGES, cfg), SLOTS, dtype, DEVICE)


class Life:
    """SGLang-like allocation: pages from a free list (page 0 never handed out), request slots 1..SLOTS-1,
    finished requests leave their complete pages to a 'tree' that later requests share as a prefix."""

    def __init__(self, G, seed):
        self.G, self.rng = G, random.Random(seed)
        self.free_pages = list(range(1, NUM_PAGES + 1))
        self.free_slots = list(range(1, SLOTS))
        self.req_to_token = torch.zeros(SLOTS, MAX_CTX, dtype=torch.int32, device=DEVICE)
        self.active: dict[int, tuple[list[int], int]] = {}  # slot -> (pages, length)
        self.tree: list[list[int]] = []  # shared complete-page prefixes, pinned until evict()
        self.shared = 0  # requests started on a shared prefix

    def start(self):
        slot = self.free_slots.pop(self.rng.randrange(len(self.free_slots)))
        pages = []
        if self.tree and self.rng.random() < 0.8:
            prefix = self.rng.choice(self.tree)
            pages = prefix[:self.rng.randint(1, len(prefix))]
            self.shared += 1
        for n, p in enumerate(pages):
            self.req_to_token[slot, n * self.G:(n + 1) * self.G] = p * self.G + torch.arange(self.G, device=DEVICE)
        self.active[slot] = (list(pages), len(pages) * self.G)

    def pick_finisher(self) -> int | None:
        """A request that holds a complete page (its prefix can enter the tree), if any."""
        long = [s for s, (_, n) in self.active.items() if n >= self.G]
        return self.rng.choice(long) if long else None

    def finish(self, slot):
        pages, n = self.active.pop(slot)
        complete = pages[:n // self.G]
        if complete and self.rng.random() < 0.8:
            self.tree.append(complete)
            self.free_pages += pages[len(complete):]
        else:
            self.free_pages += [p for p in pages if not any(p in t for t in self.tree)]
        self.free_slots.append(slot)

    def evict(self):
        """Drop a tree prefix; its pages no active request holds go back to the free list (to be reused)."""
        dropped = self.tree.pop(self.rng.randrange(len(self.tree)))
        held = {p for pages, _ in self.active.values() for p in pages} | {p for t in self.tree for p in t}
        self.free_pages += [p for p in dropped if p not in held and p not in self.free_pages]

    def decode_batch(self):
        """Advance a random subset of active requests by one token: (req slots, seq_lens, out_cache_loc)."""
        while len(self.free_pages) < 2 and self.tree:
            self.evict()
        slots = [s for s in self.active if self.rng.random() < 0.8] or list(self.active)[:1]
        kept, locs, lens = [], [], []
        for s in slots:
            pages, n = self.active[s]
            if n == MAX_CTX or (n % self.G == 0 and not self.free_pages):
                continue
            if n % self.G == 0:
                pages.append(self.free_pages.pop(self.rng.randrange(len(self.free_pages))))
                self.req_to_token[s, n:n + self.G] = pages[-1] * self.G + torch.arange(self.G, device=DEVICE)
            locs.append(pages[-1] * self.G + n % self.G)
            lens.append(n + 1)
            kept.append(s)
            self.active[s] = (pages, n + 1)
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=DEVICE)  # noqa: E731
        return t(kept), t(lens), t(locs)


def per_request(plan: PagedPlan, b: int):
    kv = plan.kv_indices[plan.kv_indptr[b]:plan.kv_indptr[b + 1]].tolist()
    ov = plan.ov_indices[plan.ov_indptr[b]:plan.ov_indptr[b + 1]].tolist()
    return kv, ov, int(plan.kv_last_page_len[b]), int(plan.ov_last_page_len[b])


def assert_same_pool(a: QuantizedKVStore, b: QuantizedKVStore):
    G = a.G
    # Base pages 1.. (the device path may also write dummy page 0: GEAR compresses every row's frame, static shapes)
    for name, (shape, _) in a.shape.base_shapes().items():
        skip = G if shape[1] == a.shape.S else 1
        assert torch.equal(getattr(a, name)[:, skip:], getattr(b, name)[:, skip:]), name
    for name in ("ov_tag", "ov_gen", "pages_quantized"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    if a.cfg.format.codec.needs_queries:  # the saliency accumulated so far, on every frame holding a page
        live = (a.ov_tag >= 0).nonzero().squeeze(1)
        assert torch.equal(a.ov_score[:, live], b.ov_score[:, live])
    frames = (a.ov_tag >= 0).nonzero().squeeze(1)
    assert torch.equal(a.ov_k[:, frames], b.ov_k[:, frames]) and torch.equal(a.ov_v[:, frames], b.ov_v[:, frames])
    # page 0 (the dummy page) may be bumped once per padded row on the device path, once per batch on the host
    assert torch.equal(a.page_gen[1:], b.page_gen[1:])
    assert G == b.G


DEVICE_CASES = [(16, 2, 0, "kivi"), (16, 1, 16, "kivi"), (32, 4, 64, "kivi"), (16, 2, 32, "kivi"), (16, 2, 16, "gear"),
                (16, 2, 16, "zipcache"), (16, 2, 16, "logquant"), (16, 3, 16, "kivi")]


# CI: no window (R = 0) and zipcache (a window, extras and the saliency write); the other widths, windows and
# formats repeat what those walk (30-60 s each under the interpreter; a width changes only the page write, bit-exact
# in test_kernels_quantize.py, and each format's read is test_format_matrix.py's): KVQ_TEST_MATRIX=all walks them
@pytest.mark.parametrize("G,bits,residual,method", ci_slice(DEVICE_CASES, [DEVICE_CASES[i] for i in (0, 5)]))
def test_device_decode_metadata_matches_the_host_path(G, bits, residual, method, triton_interpret):
    torch.manual_seed(G * bits + residual)
    host, dev = make_store(G, bits, residual, method=method), make_store(G, bits, residual, method=method)
    life = Life(G, seed=100 * G + 10 * bits + residual)
    bufs = DecodeBuffers(SLOTS, MAX_CTX // G, host.ring, torch.device(DEVICE))
    ws = dec.DecodeWorkspace(SLOTS, HQ, H, D, torch.device(DEVICE))
    steps = stale = 0
    for _ in range(100 if triton_interpret else 400):
        if life.free_slots and (not life.active or life.rng.random() < 0.08):
            life.start()
        if life.rng.random() < 0.1 and (done := life.pick_finisher()) is not None:
            life.finish(done)
            continue
        if not life.active:
            continue
        req, lens, locs = life.decode_batch()
        if not req.numel():
            continue
        k, v, q = torch.randn(len(req), H, D), torch.randn(len(req), H, D), torch.randn(len(req), HQ, D)
        k, v, q = k.to(DEVICE), v.to(DEVICE), q.to(DEVICE)
        ref = build_forward_plan(host, life.req_to_token, req, lens, locs, is_decode=True).steps[0]
        host.write_layer(0, ref.write, k, v, q=q, sm_scale=SCALE)  # q: zipcache2's saliency
        want = attention_ref.ref_decode(q, host.layer_view(0), ref.plan, SCALE)

        write, plan = build_decode(dev, life.req_to_token, req, lens, locs, bufs)
        dev.write_decode_layer(0, write, k, v, q=q, sm_scale=SCALE)
        dp = dec.plan(plan, num_qo_heads=HQ, num_kv_heads=H, head_dim=D, page_size=G, workspace=ws)
        got = dec.decode_attention(q, dev.layer_view(0), dp, SCALE)

        for b in range(len(req)):
            kv, ov, _, _ = per_request(ref.plan, b)
            stale += len(ov) < min(host.ring, len(kv) + len(ov))  # a window page whose frame was lost
            assert per_request(plan, b) == per_request(ref.plan, b), (steps, b)
        assert_same_pool(host, dev)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        steps += 1
    # the walk must have met what the metadata has to get right, not only the easy cases
    assert steps > 60 and (stale > 0 or host.ring == 1) and int((host.page_gen[1:] > 1).sum()) > 0 and life.shared > 0


def test_one_set_of_buffers_serves_every_padded_replay(triton_interpret):
    """What a decode CUDA graph of batch size 4 relies on, checked on any device: each replay writes the same
    tensors (addresses fixed at capture), and padding rows (slot 0, loc 0, len 1) change nothing real."""
    G, bs = 16, 4
    eager, graph = make_store(G, 2, 16), make_store(G, 2, 16)
    life = Life(G, seed=7)
    for _ in range(3):
        life.start()
    bufs = DecodeBuffers(8, MAX_CTX // G, graph.ring, torch.device(DEVICE))
    ws = dec.DecodeWorkspace(8, HQ, H, D, torch.device(DEVICE))
    captured = None
    for step in range(40 if triton_interpret else 120):
        req, lens, locs = life.decode_batch()
        n = len(req)
        q, k, v = torch.randn(bs, HQ, D, device=DEVICE), torch.randn(bs, H, D, device=DEVICE), \
            torch.randn(bs, H, D, device=DEVICE)
        pad = bs - n
        preq = torch.cat([req, req.new_zeros(pad)])
        plens = torch.cat([lens, lens.new_ones(pad)])
        plocs = torch.cat([locs, locs.new_zeros(pad)])

        ref_w, ref_plan = build_decode(eager, life.req_to_token, req, lens, locs,
                                       DecodeBuffers(8, MAX_CTX // G, eager.ring, torch.device(DEVICE)))
        eager.write_decode_layer(0, ref_w, k[:n], v[:n])
        want = dec.decode_attention(q[:n].contiguous(), eager.layer_view(0),
                                    dec.plan(ref_plan, num_qo_heads=HQ, num_kv_heads=H, head_dim=D, page_size=G),
                                    SCALE)

        write, plan = build_decode(graph, life.req_to_token, preq, plens, plocs, bufs)
        graph.write_decode_layer(0, write, k, v)
        dp = dec.plan(plan, num_qo_heads=HQ, num_kv_heads=H, head_dim=D, page_size=G, workspace=ws)
        got = dec.decode_attention(q, graph.layer_view(0), dp, SCALE)

        tensors = [write.frame_ids, write.frame_offs, write.done_pages, *vars(plan).values(), dp.num_splits,
                   dp.o_partial, dp.lse_partial]
        ptrs = [t.data_ptr() for t in tensors]
        captured = captured or ptrs
        assert ptrs == captured, f"step {step}: a graph input moved"
        torch.testing.assert_close(got[:n], want, atol=1e-5, rtol=1e-5)
        for name in ("k_codes", "k_scale", "k_zero", "v_codes", "v_scale", "v_zero"):
            a, b = getattr(eager, name), getattr(graph, name)
            rows = slice(G, None) if a.shape[1] == eager.shape.S else slice(1, None)
            assert torch.equal(a[:, rows], b[:, rows]), name  # everything but the dummy page 0
        real = torch.arange(frame_of(1, 0, graph.ring), graph.ov_tag.numel(), device=DEVICE)  # frames of slots 1..
        assert torch.equal(eager.ov_tag[real], graph.ov_tag[real])
        assert torch.equal(eager.ov_gen[real], graph.ov_gen[real])
        assert int(eager.pages_quantized) == int(graph.pages_quantized)  # padding rows quantize no page
    assert int(graph.pages_quantized) > 0


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graph capture needs a GPU")
@pytest.mark.parametrize("method", ["kivi", "zipcache"])  # zipcache: the saliency accumulator and page selection
def test_cuda_graph_capture_and_replay_of_a_decode_step(method):
    G, bs = 16, 4
    eager, graph = make_store(G, 2, 16, torch.float16, method), make_store(G, 2, 16, torch.float16, method)
    life = Life(G, seed=11)
    for _ in range(4):
        life.start()
    bufs = DecodeBuffers(bs, MAX_CTX // G, graph.ring, torch.device(DEVICE))
    ws = dec.DecodeWorkspace(bs, HQ, H, D, torch.device(DEVICE))
    static = {"req": torch.zeros(bs, dtype=torch.int64, device=DEVICE),
              "lens": torch.ones(bs, dtype=torch.int64, device=DEVICE),
              "locs": torch.zeros(bs, dtype=torch.int64, device=DEVICE),
              "q": torch.zeros(bs, HQ, D, dtype=torch.float16, device=DEVICE),
              "k": torch.zeros(bs, H, D, dtype=torch.float16, device=DEVICE),
              "v": torch.zeros(bs, H, D, dtype=torch.float16, device=DEVICE)}

    def step():
        write, plan = build_decode(graph, life.req_to_token, static["req"], static["lens"], static["locs"], bufs)
        graph.write_decode_layer(0, write, static["k"], static["v"], q=static["q"], sm_scale=SCALE)
        dp = dec.plan(plan, num_qo_heads=HQ, num_kv_heads=H, head_dim=D, page_size=G, workspace=ws)
        return dec.decode_attention(static["q"], graph.layer_view(0), dp, SCALE)

    step()  # warm up (compiles the kernels) on the padding rows only
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = step()
    for _ in range(60):
        req, lens, locs = life.decode_batch()
        n = len(req)
        q = torch.randn(n, HQ, D, dtype=torch.float16, device=DEVICE)
        k, v = torch.randn(n, H, D, dtype=torch.float16, device=DEVICE), \
            torch.randn(n, H, D, dtype=torch.float16, device=DEVICE)
        for name, x, fill in (("req", req, 0), ("lens", lens, 1), ("locs", locs, 0)):
            static[name].fill_(fill)
            static[name][:n] = x
        for name, x in (("q", q), ("k", k), ("v", v)):
            static[name].zero_()
            static[name][:n] = x
        g.replay()
        w, p = build_decode(eager, life.req_to_token, req, lens, locs,
                            DecodeBuffers(bs, MAX_CTX // G, eager.ring, torch.device(DEVICE)))
        eager.write_decode_layer(0, w, k, v, q=q, sm_scale=SCALE)
        want = dec.decode_attention(q, eager.layer_view(0),
                                    dec.plan(p, num_qo_heads=HQ, num_kv_heads=H, head_dim=D, page_size=G), SCALE)
        torch.testing.assert_close(out[:n], want, atol=2e-3, rtol=2e-3)
