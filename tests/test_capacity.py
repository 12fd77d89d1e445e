"""The KV budget split (sgl_kvq/capacity.py) over a grid of budgets and model shapes: a kvq pool never holds fewer
tokens than the model dtype's pool in the same budget, comes close to the packed ratio once one request's fp16
state fits the default share, refuses an explicit --max-running-requests it cannot hold with the largest value that
fits, and charges exactly what the store and SpeCache's state allocate."""

from __future__ import annotations

import pytest
import torch

from sgl_kvq.capacity import per_request_bytes, per_token_bytes, split_budget
from sgl_kvq.config import DTYPE_NAMES, KVQConfig, KVQConfigError, parse_kv_cache_dtype
from sgl_kvq.kv_store import QuantizedKVStore
from sgl_kvq.layout import PoolShape

# (layers, KV heads, head_dim, model dtype) as the HF configs give them; no weights needed.
MODELS = {
    "smollm2-135m": (30, 3, 64, torch.bfloat16),
    "tiny-llama": (2, 2, 16, torch.float32),
    "llama-3-8b": (32, 8, 128, torch.bfloat16),
    "qwen2.5-7b": (28, 4, 128, torch.bfloat16),
}
BUDGETS_GIB = (0.05, 0.25, 0.5, 1, 4, 16, 64)
# The targets at SGLang's default flags (packed ratios: kivi2 6.40x, kivi4 3.56x, kivi1 10.67x; SmolLM2:
# gear2 4.13x, gearl2 4.57x, logquant2 5.82x, zipcache2 3.46x).
TARGET = {"kivi4": 3.2, "kivi2": 5.0, "kivi1": 9.0, "specache2": 5.0, "specache1": 9.0, "gear2": 3.7, "gearl2": 4.1,
          "logquant2": 5.0, "zipcache2": 3.1}
GIB = 2**30


def shape_of(model: str, dtype_name: str) -> tuple[PoolShape, torch.dtype]:
    L, H, D, model_dtype = MODELS[model]
    return PoolShape(layers=L, heads=H, head_dim=D, num_pages=0, cfg=parse_kv_cache_dtype(dtype_name)), model_dtype


def one_request_budget(shape: PoolShape, model_dtype) -> float:
    """The budget from which the default share holds the state of one running request (two request slots)."""
    return 2 * per_request_bytes(shape, model_dtype) / shape.cfg.overlay_share


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name", DTYPE_NAMES)
@pytest.mark.parametrize("host_is_device", [False, True], ids=["gpu", "cpu-engine"])
def test_default_split_over_budgets(model, name, host_is_device):
    shape, model_dtype = shape_of(model, name)
    cpu_specache = shape.cfg.is_specache and host_is_device
    for gib in BUDGETS_GIB:
        budget = int(gib * GIB)
        try:
            s = split_budget(budget, shape, model_dtype, host_is_device=host_is_device, context_len=8192)
        except KVQConfigError as e:
            # Only where not even one request's fp16 state fits next to bf16's tokens; the message says the budget.
            assert budget < one_request_budget(shape, model_dtype) and "raise the KV budget" in str(e)
            continue
        assert s.max_running_requests >= 1
        assert s.request_bytes + s.tokens * s.per_token_bytes <= budget
        if cpu_specache:
            # Host tier and device pool share the CPU engine's RAM: 16-bit rows + packed codes per token.
            assert s.ratio < 1
            continue
        assert s.tokens >= s.dense_tokens, (model, name, gib, s.describe(name))
        if budget >= one_request_budget(shape, model_dtype):
            assert s.request_bytes <= shape.cfg.overlay_share * budget
            assert s.ratio >= TARGET[shape.cfg.name], (model, name, gib, s.describe(name))


@pytest.mark.parametrize("name", ["kivi2", "kivi4"])
@pytest.mark.parametrize("gib", [0.25, 0.3, 1, 4])
def test_smollm2_meets_the_targets_from_a_few_hundred_mb(name, gib):
    shape, model_dtype = shape_of("smollm2-135m", name)
    s = split_budget(int(gib * GIB), shape, model_dtype, host_is_device=True, context_len=8192)
    assert s.ratio >= TARGET[name] and s.max_running_requests >= 3, s.describe(name)


@pytest.mark.parametrize("model", ["smollm2-135m", "llama-3-8b"])
@pytest.mark.parametrize("name", ["kivi2", "kivi4", "specache2"])
def test_explicit_max_running_requests_fits_or_names_the_largest(model, name):
    shape, model_dtype = shape_of(model, name)
    budget = 4 * GIB
    default = split_budget(budget, shape, model_dtype, host_is_device=False)
    with pytest.raises(KVQConfigError, match=r"use --max-running-requests (\d+) or less") as err:
        split_budget(budget, shape, model_dtype, host_is_device=False, requested=10**6)
    largest = int(err.value.args[0].split("use --max-running-requests ")[1].split()[0])
    assert largest > default.max_running_requests
    s = split_budget(budget, shape, model_dtype, host_is_device=False, requested=largest)
    assert s.max_running_requests == largest and s.tokens >= s.dense_tokens
    with pytest.raises(KVQConfigError, match=str(largest)):
        split_budget(budget, shape, model_dtype, host_is_device=False, requested=largest + 1)


def test_llama_8b_at_a_24gb_gpu_budget_no_longer_loses_to_bf16():
    """The issue's case: 257 fixed slots x 16 MiB of frames took most of a 24 GB GPU's KV budget."""
    shape, model_dtype = shape_of("llama-3-8b", "kivi2")
    assert per_request_bytes(shape, model_dtype) == 2 * (2 * 32 * 64 * 8 * 128 * 2 + 16)
    s = split_budget(int(5 * GIB), shape, model_dtype, host_is_device=False, context_len=8192)
    assert s.ratio >= 5.9 and s.max_running_requests >= 16, s.describe("kivi2")


def test_a_budget_that_holds_no_request_is_refused_with_the_budget_that_would():
    shape, model_dtype = shape_of("llama-3-8b", "specache2")
    with pytest.raises(KVQConfigError, match=r"above \d+\.\d+ GiB"):
        split_budget(int(0.02 * GIB), shape, model_dtype, host_is_device=False)


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_the_charge_is_what_the_pool_allocates(name):
    """per_request_bytes / per_token_bytes must equal what QuantizedKVStore (and SpeCache's state) allocate."""
    cfg = KVQConfig(method=parse_kv_cache_dtype(name).method, bits=parse_kv_cache_dtype(name).bits, group_size=16,
                    value_group=16, residual=16, top_k=8)
    shape = PoolShape(layers=2, heads=2, head_dim=32, num_pages=6, cfg=cfg)
    slots = 5
    store = QuantizedKVStore(cfg, shape, slots, torch.float16, "cpu")
    overlay = store.overlay_bytes()
    if cfg.is_specache:
        from sgl_kvq.specache.state import SpeCacheState

        overlay += SpeCacheState(cfg, shape, slots, torch.float16, torch.device("cpu")).device_bytes()
    assert overlay == slots * per_request_bytes(shape, torch.float16)
    # SGLang's cell is whole bytes: a format with per-page tensors of a size G does not divide (zipcache2's salient
    # offsets) is charged under one byte per token more than it allocates, never less.
    charged = shape.P * shape.G * per_token_bytes(shape, torch.float16, host_is_device=False)
    assert store.base_bytes() == shape.P * shape.G * shape.base_bytes_per_token()
    assert 0 <= charged - store.base_bytes() < shape.P * shape.G


def test_overlay_share_knob_is_validated(monkeypatch):
    monkeypatch.setenv("KVQ_OVERLAY_SHARE", "1.5")
    with pytest.raises(KVQConfigError, match="KVQ_OVERLAY_SHARE"):
        parse_kv_cache_dtype("kivi2")
    monkeypatch.setenv("KVQ_OVERLAY_SHARE", "0.2")
    assert parse_kv_cache_dtype("kivi2").overlay_share == 0.2
    assert parse_kv_cache_dtype("kivi2") is parse_kv_cache_dtype("kivi2")  # parsed once per name and knobs


def test_specache_on_a_gpu_is_capped_by_the_host_ram_its_tier_may_take():
    """Default flags on a GPU must not fail on the host tier: the pool holds what the host RAM allowed holds."""
    from sgl_kvq.specache.host_tier import check_host_budget, host_bytes_per_token

    shape, model_dtype = shape_of("llama-3-8b", "specache2")
    host_budget = 64 * GIB
    s = split_budget(60 * GIB, shape, model_dtype, host_is_device=False, context_len=8192,
                     host_budget_bytes=host_budget)
    per_host_token = host_bytes_per_token(32, 8, 128, model_dtype)
    assert s.tokens == s.host_token_cap < split_budget(60 * GIB, shape, model_dtype, host_is_device=False).tokens
    assert s.tokens % 64 == 0 and "host tier caps" in s.describe("specache2")
    # The tier the pool then builds (its tokens plus page 0) passes the startup check at the same budget.
    check_host_budget("specache2", s.tokens + 64, per_host_token, 1.0, available=host_budget)
    kivi = shape_of("llama-3-8b", "kivi2")[0]
    assert split_budget(60 * GIB, kivi, model_dtype, host_is_device=False,
                        host_budget_bytes=host_budget).host_token_cap is None
