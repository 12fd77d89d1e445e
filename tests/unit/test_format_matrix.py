"""One matrix over the format registry: every --kv-cache-dtype name (sgl_kvq/formats/registry.py, the peers'
formats included) written through a real pool's store and read back by every path that can read it. A format added
to the registry is in this matrix without an edit here.

- Round trip: each request's context as the store gives it back (attention_ref.gather_context) against the K/V
  written, by error statistics bounded by the code width; the quantized part must differ from what was written.
- Page steps: kvq_torch's paged extend reads each base page once per layer over its steps (StepReads) and gives
  every step the context gather_context reads.
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
from sgl_kvq import attention_extend  # noqa: E402
from sgl_kvq.attention_extend import StepReads  # noqa: E402
from sgl_kvq.attention_ref import gather_context, ref_decode  # noqa: E402
from sgl_kvq.config import parse_kv_cache_dtype  # noqa: E402
from sgl_kvq.formats.registry import DTYPE_NAMES  # noqa: E402
from sgl_kvq.layout import PoolShape  # noqa: E402
from sgl_kvq.metadata.host import plan_contexts  # noqa: E402
from sgl_kvq.pool import KVQTokenToKVPool  # noqa: E402
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


def test_page_steps_read_each_page_once_and_give_every_step_the_full_read(written, monkeypatch):
    name, cfg, pool, _, lengths, ids = written
    G = cfg.group_size
    reads = []
    real_read = attention_extend.read_base
    monkeypatch.setattr(attention_extend, "read_base",
                        lambda kv, pages: reads.append(pages.numel()) or real_read(kv, pages))
    forward_plan, steps = object(), StepReads()
    reqs = list(range(len(lengths)))
    for layer in range(L):
        kv = pool.store.layer_view(layer)
        reads.clear()
        for j in range(1, max(lengths) // G + 1):  # step j: every request's first j whole pages (or all it has)
            lens = [min(n // G, j) * G for n in lengths]
            step = plan_contexts(pool.store, list(ids), reqs, lens)
            got = steps.contexts(forward_plan, layer, kv, step)
            for b in reqs:
                want = gather_context(kv, step, b)
                assert all(torch.equal(x, y) for x, y in zip(got[b], want)), (name, layer, j, b)
        base_pages = sum(int(step.kv_indptr[b + 1] - step.kv_indptr[b]) for b in reqs)
        assert sum(reads) == base_pages, (name, layer, reads)  # each page read once, not once per step
    other = plan_contexts(pool.store, list(ids), reqs, [n // G * G for n in lengths])
    got = steps.contexts(object(), 0, pool.store.layer_view(0), other)  # another forward: nothing carried over
    assert all(torch.equal(got[b][0], gather_context(pool.store.layer_view(0), other, b)[0]) for b in reqs)


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
    assert (decode_paths.PAGES in ran) == cfg.format.plain_pages, (name, ran)
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
        if not cfg.format.plain_pages:
            assert path == decode_paths.PADDED, (name, path)
