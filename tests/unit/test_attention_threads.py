"""KVQ_ATTENTION_THREADS: kvq_torch's batched decode runs with that many intra-op threads on a CPU, and the
process's count is back after it (what the engine's other ops run with)."""

from __future__ import annotations

import collections

import pytest
import torch

from sgl_kvq.backends.torch_backend import intra_op_threads
from sgl_kvq.config import KVQConfig, KVQConfigError, parse_kv_cache_dtype


@pytest.fixture
def two_threads():
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(prev)


@pytest.mark.parametrize("n, inside", [(1, 1), (0, 2), (4, 2)])
def test_limits_then_restores(two_threads, n, inside):
    with intra_op_threads(n, torch.device("cpu")):
        assert torch.get_num_threads() == inside
    assert torch.get_num_threads() == 2


def test_restores_after_an_error(two_threads):
    with pytest.raises(RuntimeError):
        with intra_op_threads(1, torch.device("cpu")):
            raise RuntimeError("attention failed")
    assert torch.get_num_threads() == 2


def test_not_applied_off_cpu(two_threads):
    with intra_op_threads(1, torch.device("meta")):
        assert torch.get_num_threads() == 2


def test_knob(monkeypatch):
    assert KVQConfig("kivi", 2).attention_threads == 0
    monkeypatch.setenv("KVQ_ATTENTION_THREADS", "1")
    assert parse_kv_cache_dtype("kivi2").attention_threads == 1
    monkeypatch.setenv("KVQ_ATTENTION_THREADS", "-1")
    with pytest.raises(KVQConfigError, match="KVQ_ATTENTION_THREADS=-1 must be 0 .* e.g. 1"):
        parse_kv_cache_dtype("kivi2")


@pytest.mark.parametrize("path", ["padded", "pages"])
def test_kvq_torch_decode_runs_under_the_limit(two_threads, monkeypatch, path):
    from types import SimpleNamespace

    from sgl_kvq import attention_batched, attention_pages, padded
    from sgl_kvq.backends.torch_backend import KVQTorchBackend

    seen = []
    (builder, build), module = ((padded, "prepare"), attention_batched) if path == "padded" else \
        ((attention_pages, "index"), attention_pages)
    monkeypatch.setattr(attention_pages, "pays_off", lambda plan, G: path == "pages")
    built = attention_pages.PageIndex.__new__(attention_pages.PageIndex) if path == "pages" else object()
    monkeypatch.setattr(builder, build, lambda plan, G, H: seen.append((build, torch.get_num_threads())) or built)
    monkeypatch.setattr(module, "decode",
                        lambda q, kv, idx, sm, ws, window: seen.append(("decode", torch.get_num_threads())) or q)
    backend = KVQTorchBackend.__new__(KVQTorchBackend)
    backend._plan_derived, backend._workspace, backend._cpu_kernel = (None, {}), None, False
    backend.pool = SimpleNamespace(decode_batches=collections.Counter())
    backend.store = SimpleNamespace(cfg=KVQConfig("kivi", 2, attention_threads=1), device=torch.device("cpu"), G=64,
                                    shape=SimpleNamespace(heads=3),
                                    layer_view=lambda li: SimpleNamespace(extras=None))
    q = torch.zeros(1, 3, 64)
    assert backend.decode(q, 0, SimpleNamespace(plan=object()), 0.125, -1) is q
    assert seen == [(build, 1), ("decode", 1)] and torch.get_num_threads() == 2
    assert backend.pool.decode_batches == {path: 1}


def test_cpu_kernel_knob(monkeypatch):
    """KVQ_CPU_KERNEL: 1 (the C decode kernel where a compiler is found) by default, 0 keeps the torch paths,
    anything else is refused when the flag is parsed, before a model loads."""
    assert KVQConfig("kivi", 2).cpu_kernel == 1
    monkeypatch.setenv("KVQ_CPU_KERNEL", "0")
    assert parse_kv_cache_dtype("kivi2").cpu_kernel == 0
    monkeypatch.setenv("KVQ_CPU_KERNEL", "2")
    with pytest.raises(KVQConfigError, match="KVQ_CPU_KERNEL=2 must be 0 .* or 1"):
        parse_kv_cache_dtype("kivi2")
