"""The CPU decode kernel (kernels/cpu_decode_attention.c) against its oracle attention_ref.ref_decode on random pools:
batch sizes 1..9, GQA groups 1..4, 1/2/3/4 bits, pages of 8..128 tokens, head dims 24..128, 1..4 value groups,
contexts shorter than a page, partial last pages and frames (NaN past each end), empty overlays or bases; fp32
within 1e-5, one thread and two, tasks split down to one unit (the partial merge); the engine's 16-bit dtypes; the
layout check; the build cache. Skipped only where no C compiler is on PATH (then kvq_torch keeps its torch paths)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from paged_pool import (EDGE_BATCHES, EDGE_IDS, check_edge_batch, check_reads_only_the_batch_pages,
                        check_scales_are_read, make_pool, random_requests)
from sgl_kvq.attention_ref import ref_decode
from sgl_kvq.kernels import cpu_decode_attention as cda

pytestmark = pytest.mark.skipif(cda.compiler() is None, reason="no C compiler on PATH: the kernel cannot be built")

SHAPES = [  # (G, H, D, VG)
    (16, 2, 64, 64),
    (64, 3, 64, 64),  # SmolLM2's KV geometry
    (32, 1, 128, 32),
    (8, 2, 24, 8),  # the smallest page, a head dim that is no power of two, 3 value groups
    (128, 1, 32, 16),
]


@pytest.fixture
def threads():
    prev = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(prev)


def test_builds_here():
    """With a compiler on PATH the kernel must build and load; a failed build is a failure, not a skip."""
    assert cda.available(), cda.unavailable_reason()


def decode(q, kv, plan):
    return cda.decode_attention(q, kv, plan, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("B", range(1, 10))
@pytest.mark.parametrize("group", [1, 2, 3, 4])
@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_matches_reference(B, group, bits):
    rng = random.Random(B * 100 + group * 10 + bits + 2)
    G, H, D, VG = SHAPES[(B + group + bits) % len(SHAPES)]
    kv, plan = make_pool(G, H, D, VG, bits, random_requests(rng, B, G), torch.float32, seed=B + 7 * bits + 2)
    q = torch.randn(B, H * group, D, generator=torch.Generator().manual_seed(group))
    out = decode(q, kv, plan)
    assert not out.isnan().any(), "a position past a context's end (NaN in the pool) reached the output"
    torch.testing.assert_close(out, ref_decode(q, kv, plan, D ** -0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k_bits,v_bits", list(itertools.permutations((1, 2, 3, 4), 2)))
def test_key_and_value_widths_differ(k_bits, v_bits):
    """A recipe's layer (kivimix): keys and values at their own widths, each pair its own specialized copy of the
    kernel's task; the frames lie apart by different strides, as pooled frames over key and value codes of different
    widths do."""
    rng = random.Random(k_bits * 10 + v_bits)
    for group, (G, H, D, VG) in ((1, SHAPES[0]), (3, SHAPES[-1])):
        kv, plan = make_pool(G, H, D, VG, k_bits, random_requests(rng, 4, G), torch.float32, seed=k_bits + v_bits,
                             v_bits=v_bits, frame_gap=16 * k_bits, v_frame_gap=16 * v_bits)
        q = torch.randn(4, H * group, D, generator=torch.Generator().manual_seed(group))
        torch.testing.assert_close(decode(q, kv, plan), ref_decode(q, kv, plan, D ** -0.5), rtol=1e-5, atol=1e-5)


def test_frames_apart_as_pooled_kivi3():
    """Pooled kivi3 frames lie k pages' codes apart (sgl_kvq/frames.py frame_view): the kernel takes their stride."""
    G, H, D, VG = SHAPES[1]
    kv, plan = make_pool(G, H, D, VG, 3, random_requests(random.Random(5), 6, G), torch.bfloat16, seed=5,
                         frame_gap=3 * D)
    assert not kv.ov_k.is_contiguous()
    q = torch.randn(6, H * 3, D, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(decode(q, kv, plan), ref_decode(q, kv, plan, D ** -0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("reqs", EDGE_BATCHES, ids=EDGE_IDS)
def test_edge_batches(reqs):
    check_edge_batch(decode, reqs)


def test_reads_only_the_batch_pages():
    check_reads_only_the_batch_pages(decode, *SHAPES[0])


def test_scales_are_read():
    check_scales_are_read(decode, *SHAPES[1])


@pytest.mark.parametrize("n_threads", [1, 2])
def test_split_tasks_and_threads_agree(threads, monkeypatch, n_threads):
    """Long ragged contexts split into tasks of one unit each (every request's chunks merged by their running max
    and sum), on one thread and two: the reference's output either way."""
    threads(n_threads)
    monkeypatch.setattr(cda, "_MIN_TOKENS_PER_TASK", 1)
    monkeypatch.setattr(cda, "_TASKS_PER_THREAD", 1000)
    G, H, D, VG = 16, 2, 64, 32
    reqs = [(20 * G, 7), (3 * G + 5, 0), (0, 9), (8 * G, G)]
    kv, plan = make_pool(G, H, D, VG, 2, reqs, torch.float32, seed=21)
    assert cda.chunk_units(plan, G, H, n_threads) == 1
    q = torch.randn(len(reqs), H * 4, D, generator=torch.Generator().manual_seed(21))
    torch.testing.assert_close(decode(q, kv, plan), ref_decode(q, kv, plan, D ** -0.5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_model_dtypes(dtype):
    """The engine's dtypes: overlay and q in 16 bits, output in q's dtype (reference within its rounding)."""
    G, H, D, VG = SHAPES[1]
    reqs = [(2 * G, G + 3), (G - 1, 0), (0, 40)]
    kv, plan = make_pool(G, H, D, VG, 4, reqs, dtype, seed=11)
    q = torch.randn(len(reqs), H * 3, D).to(dtype)
    out = decode(q, kv, plan)
    assert out.dtype == dtype
    ref = ref_decode(q.float(), kv, plan, D ** -0.5)  # the reference in fp32 over the same 16-bit overlay
    torch.testing.assert_close(out, ref.to(dtype), rtol=0, atol=float(torch.finfo(dtype).eps) * 4)


def test_layout_check_names_the_buffer():
    G, H, D, VG = SHAPES[0]
    kv, plan = make_pool(G, H, D, VG, 2, [(2 * G, 3)], torch.float32, seed=1)
    q = torch.randn(1, H, D)
    bad = kv.__class__(**{**kv.__dict__, "k_scale": kv.k_scale.to(torch.float32)})
    with pytest.raises(ValueError, match="k_scale: .* the kernel reads .*float16"):
        decode(q, bad, plan)
    strided = kv.__class__(**{**kv.__dict__, "v_codes": kv.v_codes.transpose(0, 1).contiguous().transpose(0, 1)})
    with pytest.raises(ValueError, match="v_codes: .*contiguous: False"):
        decode(q, strided, plan)
    for extra in ({"fmt": "gear"}, {"fmt": "logquant"}, {"fmt": "zipcache"}):
        assert not cda.supports(make_pool(G, H, D, VG, 2, [(2 * G, 3)], torch.float32, seed=1, **extra)[0])


def test_build_is_cached(tmp_path, monkeypatch):
    """A second build on the same machine reuses the library instead of compiling again."""
    monkeypatch.setenv("KVQ_CACHE_DIR", str(tmp_path))
    first = cda._build(cda.compiler())
    mtime = first.stat().st_mtime_ns
    assert cda._build(cda.compiler()) == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary file left behind
