"""One matrix over the format registry: every --kv-cache-dtype name (sgl_kvq/formats/registry.py, the peers'
formats included) written through a real pool's store and read back by every path that can read it. A format added
to the registry is in this matrix without an edit here.

- Round trip: each request's context as the store gives it back (attention_ref.gather_context) against the K/V
  written, by error statistics bounded by the code width; the quantized part must differ from what was written.
- Paged prefill: kvq_torch's paged extend in one step (attention_extend.extend_paged) writes the same pool, bit for
  bit, and attends to the same keys as the page steps of the same extends.
- Decode paths: every path of sgl_kvq/decode_paths.py that reads the format, and the Triton decode kernel where the
  format has one (Format.kernel), against attention_ref.ref_decode on the same pool.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any triton import (tests/conftest.py does the same)

import pytest  # noqa: E402

pytest.importorskip("sglang")

from sgl_kvq import decode_paths  # noqa: E402
import dataclasses  # noqa: E402

from sgl_kvq import attention_extend  # noqa: E402
from sgl_kvq.attention_ref import frame_rows, gather_context, ref_decode  # noqa: E402
from sgl_kvq.config import parse_kv_cache_dtype  # noqa: E402
from sgl_kvq.formats.registry import DTYPE_NAMES  # noqa: E402
from sgl_kvq.metadata.forward import build_forward_plan  # noqa: E402
from sgl_kvq.metadata.host import plan_contexts  # noqa: E402
from sgl_kvq.pool import KVQTokenToKVPool  # noqa: E402
from sgl_kvq.pool_shape import PoolShape  # noqa: E402
from kernel_checks import DEVICE, to_device  # noqa: E402
from pool_writes import HQ, L, SM, H, D, kv_of, write  # noqa: E402

# Relative RMS error of a whole context (base pages and fp16 window) against what was written, at most, by the
# code width of the dtype: about 1.5x the worst format of each width on these inputs (measured 2026-11-28: 1 bit
# 0.63 kivi1, 2 bits 0.40 kivi2, 3 bits 0.20 peer_tq3, 4 bits 0.11 peer_fp4_mx_block16, 8 bits 0.027)
MAX_REL_RMS = {1: 0.95, 2: 0.6, 3: 0.3, 4: 0.17, 8: 0.04}


def _lengths(G: int, ring: int) -> list[int]:
    """Requests within the open page, exactly one page, and two whose base pages lie beyond the fp16 window."""
    return [G // 2 + 1, G, (ring + 2) * G + 5, (ring + 4) * G + G // 3]


@pytest.fixture(scope="module", params=DTYPE_NAMES)
def written(request):
    """A pool of dtype `name` with four requests written through the store (chunked: two writes each)."""
    name = request.param
    cfg = parse_kv_cache_dtype(name)
    G = cfg.group_size
    lengths = _lengths(G, cfg.ring_pages)
    n_pages = [-(-n // G) for n in lengths]
    P = sum(n_pages) + 2
    pool = KVQTokenToKVPool(P * G, PoolShape(L, H, D, P, cfg), "cpu", torch.float32, num_req_slots=len(lengths))
    ids = (torch.randperm(P - 1, generator=torch.Generator().manual_seed(3)) + 1)[:sum(n_pages)].split(n_pages)
    for r, (pages, n) in enumerate(zip(ids, lengths)):
        write(pool, r, pages, 0, n // 2, seed=r)
        write(pool, r, pages, n // 2, n, seed=r)
    plan = plan_contexts(pool.store, list(ids), list(range(len(lengths))), lengths)
    return name, cfg, pool, plan, lengths, ids


def test_a_context_reads_back_within_its_code_widths_error(written):
    name, cfg, pool, plan, lengths, _ = written
    for layer in range(L):
        kv = pool.store.layer_view(layer)
        for b, n in enumerate(lengths):
            k, v = gather_context(kv, plan, b)
            k0, v0, _ = kv_of(torch.arange(n), layer, seed=b)
            for got, want, which in ((k, k0, "K"), (v, v0, "V")):
                assert got.shape == want.shape and torch.isfinite(got).all(), (name, which)
                rel = float((got - want).norm() / want.norm())
                assert rel <= MAX_REL_RMS[cfg.bits], f"{name} layer {layer} request {b} {which}: {rel:.3f}"
        base = [b for b in range(len(lengths)) if int(plan.kv_indptr[b + 1]) > int(plan.kv_indptr[b])]
        assert base, f"{name}: no request has base pages, the matrix reads no quantized page"
        k, _ = gather_context(kv, plan, base[-1])
        assert not torch.equal(k, kv_of(torch.arange(lengths[base[-1]]), layer, seed=base[-1])[0]), name


def _paged_extends(name: str, page_steps: bool):
    """Two requests' K/V written by two extends each in KVQ_PREFILL=paged, batched (a cold prefill, then a
    continuation whose prefix ends mid-page), as page steps or in one step -> the attention outputs and the pool."""
    cfg = dataclasses.replace(parse_kv_cache_dtype(name), prefill="paged")
    G = cfg.group_size
    lengths, cuts = [(cfg.ring_pages + 3) * G + 7, 3 * G], [G + G // 2, 2 * G]
    P = sum(-(-n // G) for n in lengths) + 2
    pool = KVQTokenToKVPool(P * G, PoolShape(L, H, D, P, cfg), "cpu", torch.float32, num_req_slots=2)
    req_to_token = torch.zeros(2, max(lengths), dtype=torch.int32)
    req_to_token[0, :lengths[0]] = torch.arange(lengths[0], dtype=torch.int32) + G  # pages 1, 2, ...
    first = -(-lengths[0] // G) + 1
    req_to_token[1, :lengths[1]] = torch.arange(lengths[1], dtype=torch.int32) + first * G
    outs = []
    for prefix, ends in (([0, 0], cuts), (cuts, lengths)):
        fp = build_forward_plan(pool.store, req_to_token, torch.tensor([0, 1]), torch.tensor(ends),
                                torch.cat([req_to_token[r, a:e] for r, (a, e) in enumerate(zip(prefix, ends))]),
                                is_decode=False, extend_prefix_lens=prefix,
                                extend_seq_lens=[e - a for a, e in zip(prefix, ends)], page_steps=page_steps)
        for layer in range(L):
            k, v, q = (torch.cat(t) for t in zip(*(kv_of(torch.arange(a, e), layer, seed=r)
                                                  for r, (a, e) in enumerate(zip(prefix, ends)))))
            kv = pool.store.layer_view(layer)
            out = torch.empty(q.shape[0], HQ, D)
            for step in fp.steps:
                rows = torch.arange(q.shape[0]) if step.rows is None else step.rows
                if step.reread is None:
                    out[rows] = attention_extend.extend(q[rows], k[rows], v[rows], step.qo_indptr, kv, step.plan, SM)
                    pool.store.write_layer(layer, step.write, k[rows], v[rows], q=q[rows], sm_scale=SM)
                else:
                    frames = [frame_rows(kv, step.plan, b) for b in range(2)]
                    pool.store.write_layer(layer, step.write, k, v, q=q, sm_scale=SM)
                    out = attention_extend.extend_paged(q, k, v, step.qo_indptr, kv, step.plan, step.reread, SM,
                                                        frames)
            outs.append(out)
    return outs, pool, req_to_token, lengths


@pytest.mark.parametrize("name", [n for n in DTYPE_NAMES if not n.startswith("specache")])  # its prefill is "full"
def test_a_paged_extend_in_one_step_writes_and_attends_as_its_page_steps(name):
    (steps_out, steps_pool, req_to_token, lengths), (one_out, one_pool, _, _) = (_paged_extends(name, True),
                                                                                  _paged_extends(name, False))
    assert len(steps_out) == len(one_out) == 2 * L
    for i, (a, b) in enumerate(zip(steps_out, one_out)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{name} extend {i // L} layer {i % L}: {m}")
    store_a, store_b = steps_pool.store, one_pool.store
    names = [n for n, t in vars(store_a).items() if isinstance(t, torch.Tensor)]
    assert "k_codes" in names and "page_gen" in names
    # Every tensor but the frames' contents is the same; a frame's rows past its page's tokens keep whatever an
    # earlier page left there (the page steps wrote every page into a frame), and no plan reads them.
    for n in set(names) - {"ov_k", "ov_v"}:
        assert torch.equal(getattr(store_a, n), getattr(store_b, n)), f"{name}: store.{n} differs"
    G = store_a.G
    tables = [req_to_token[r, :n:G].long() // G for r, n in enumerate(lengths)]
    for layer in range(L):
        plans = [plan_contexts(s, tables, [0, 1], lengths) for s in (store_a, store_b)]
        for b in range(2):
            a, c = (gather_context(s.layer_view(layer), p, b) for s, p in zip((store_a, store_b), plans))
            assert all(torch.equal(x, y) for x, y in zip(a, c)), (name, layer, b)


def test_every_decode_path_that_reads_the_format_gives_the_reference(written):
    name, cfg, pool, plan, lengths, _ = written
    G = cfg.group_size
    q = torch.randn(len(lengths), HQ, D, generator=torch.Generator().manual_seed(11))
    kv = pool.store.layer_view(L - 1)
    ref = ref_decode(q, kv, plan, SM)
    ran = []
    for path in decode_paths.PATHS:
        if not decode_paths.applies(path, kv):
            continue
        out = decode_paths.decode(path, q, kv, plan, decode_paths.prepare(path, plan, G, H), SM)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} {path}: {m}")
        ran.append(path)
    assert decode_paths.PADDED in ran
    assert (decode_paths.PAGES in ran) == cfg.format.codec.plain_pages, (name, ran)
    if cfg.format.kernel is None:
        return
    from sgl_kvq.kernels import decode_attention as dec

    p = dec.plan(to_device(plan), num_qo_heads=HQ, num_kv_heads=H, head_dim=D, page_size=G, max_splits=2,
                 min_pages_per_split=1)
    out = torch.full_like(q, float("nan"), device=DEVICE)
    dec.decode_attention(q.to(DEVICE), to_device(kv), p, SM, out=out)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name} triton: {m}")


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_the_rule_picks_a_path_that_reads_the_format(name):
    """decode_paths.choose never sends a format to a path that cannot read it, with the C kernel on or off."""
    cfg = parse_kv_cache_dtype(name)
    G = cfg.group_size
    pool = KVQTokenToKVPool(4 * G, PoolShape(L, H, D, 4, cfg), "cpu", torch.float32, num_req_slots=1)
    write(pool, 0, torch.tensor([1, 2]), 0, G + 3, seed=0)
    kv = pool.store.layer_view(0)
    plan = plan_contexts(pool.store, [torch.tensor([1, 2])], [0], [G + 3])
    for cpu_kernel in (False, True):
        path = decode_paths.choose(kv, plan, G, cpu_kernel)
        assert decode_paths.applies(path, kv) or (path == decode_paths.CPU_KERNEL and cpu_kernel), (name, path)
        if not cfg.format.codec.plain_pages:
            assert path == decode_paths.PADDED, (name, path)
