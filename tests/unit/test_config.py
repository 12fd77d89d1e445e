"""sgl_kvq/config.py: a dtype name parsed into its KVQConfig, and every knob validated by KVQConfig itself, without an
Engine (each format family's constraints declared by its module in sgl_kvq/formats/)."""

from __future__ import annotations

import pytest

from sgl_kvq.config import KVQConfig, KVQConfigError, parse_kv_cache_dtype
from sgl_kvq.formats.specache import SPECACHE_TOP_K


# ---- names ----

@pytest.mark.parametrize("name", ["kivi8", "gear4", "zipcache", "fp8_e4m3", "", "kivi02x", "peer_fp8_e4m38",
                                  "peer_tq", "peer_int44"])
def test_unknown_names_are_refused(name):
    with pytest.raises(KVQConfigError, match="unknown kv cache dtype"):
        parse_kv_cache_dtype(name)


def test_a_dtype_default_knob_comes_from_its_format():
    for bits, k in SPECACHE_TOP_K.items():
        assert parse_kv_cache_dtype(f"specache{bits}").top_k == k
    assert parse_kv_cache_dtype("kivi2").top_k == KVQConfig("kivi", 2).top_k


# ---- knobs, validated without an Engine ----

@pytest.mark.parametrize("method,bits,knobs,match", [
    ("kivi", 8, {}, "supports"),
    ("nope", 2, {}, "unknown method"),
    ("kivi", 2, {"group_size": 48}, "power of two"),
    ("kivi", 2, {"residual": 32}, "multiple of G"),
    ("gear", 2, {"gear_rank": 0}, "KVQ_GEAR_RANK"),
    ("gear", 2, {"gear_iters": 0}, "KVQ_GEAR_ITERS"),
    ("gearl", 2, {"gear_outliers": 0.5}, "KVQ_GEAR_OUTLIERS"),
    ("logquant", 2, {"logquant_window": 0}, "KVQ_LOGQUANT_WINDOW"),
    ("logquant", 2, {"group_size": 256, "residual": 256}, "at most 128"),
    ("zipcache", 2, {"zipcache_salient": 0.0}, "KVQ_ZIPCACHE_SALIENT"),
    ("zipcache", 2, {"zipcache_salient": 0.999}, "KVQ_ZIPCACHE_SALIENT"),
    ("specache", 2, {"specache_follow": 2}, "KVQ_SPECACHE_FOLLOW"),
    ("specache", 2, {"top_k": 0}, "top-k"),
    ("specache", 1, {"specache_prefix": "disk"}, "KVQ_SPECACHE_PREFIX"),
    ("specache", 2, {"prefill": "paged"}, "kivi only"),
])
def test_bad_knobs_are_refused(method, bits, knobs, match):
    with pytest.raises(KVQConfigError, match=match):
        KVQConfig(method, bits, **knobs)


def test_a_familys_knobs_are_checked_whatever_is_served():
    """KVQ_* variables reach every process a server spawns: a bad one fails at once, for any dtype."""
    with pytest.raises(KVQConfigError, match="KVQ_GEAR_RANK"):
        KVQConfig("kivi", 2, gear_rank=0)


def test_a_constraint_of_one_format_binds_only_that_format():
    KVQConfig("kivi", 2, group_size=256, residual=256)  # logquant2's G <= 128 is its own
    KVQConfig("kivi", 2, prefill="paged")  # specache's full-precision prefill is its own
