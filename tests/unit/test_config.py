"""sgl_kvq/config.py: a dtype name parsed into its KVQConfig with the KVQ_* knobs of the environment, and every knob
validated by KVQConfig itself, without an Engine (each format family's constraints declared by its module in
sgl_kvq/formats/)."""

from __future__ import annotations

import pytest

from sgl_kvq import env
from sgl_kvq.config import KVQConfig, KVQConfigError, is_kvq_dtype, looks_like_kvq_dtype, parse_kv_cache_dtype
from sgl_kvq.formats.specache import SPECACHE_TOP_K


# ---- names ----

@pytest.mark.parametrize("name", ["kivi8", "gear4", "zipcache", "fp8_e4m3", "", "kivi02x", "peer_fp8_e4m38",
                                  "peer_tq", "peer_int44"])
def test_unknown_names_are_refused(name):
    with pytest.raises(KVQConfigError, match="unknown kv cache dtype"):
        parse_kv_cache_dtype(name)


def test_a_dtype_default_knob_comes_from_its_format():
    for bits, k in SPECACHE_TOP_K.items():
        assert parse_kv_cache_dtype(f"specache{bits}").params.top_k == k
    assert parse_kv_cache_dtype("kivi2").params is None


# ---- knobs, validated without an Engine ----

@pytest.mark.parametrize("method,bits,knobs,match", [
    ("kivi", 8, {}, "supports"),
    ("nope", 2, {}, "unknown method"),
    ("kivi", 2, {"group_size": 48}, "power of two"),
    ("kivi", 2, {"residual": 32}, "multiple of G"),
    ("gear", 2, {"rank": 0}, "KVQ_GEAR_RANK"),
    ("gear", 2, {"iters": 0}, "KVQ_GEAR_ITERS"),
    ("gearl", 2, {"outliers": 0.5}, "KVQ_GEAR_OUTLIERS"),
    ("logquant", 2, {"window": 0}, "KVQ_LOGQUANT_WINDOW"),
    ("logquant", 2, {"group_size": 256, "residual": 256}, "at most 128"),
    ("zipcache", 2, {"salient": 0.0}, "KVQ_ZIPCACHE_SALIENT"),
    ("zipcache", 2, {"salient": 0.999}, "KVQ_ZIPCACHE_SALIENT"),
    ("specache", 2, {"follow": 2}, "KVQ_SPECACHE_FOLLOW"),
    ("specache", 2, {"top_k": 0}, "top-k"),
    ("specache", 1, {"prefix": "disk"}, "KVQ_SPECACHE_PREFIX"),
    ("specache", 2, {"prefill": "paged"}, "kivi only"),
    ("specache", 2, {"host_mem_fraction": 0.0}, "KVQ_HOST_MEM_FRACTION"),
    ("specache", 1, {"host_mem_fraction": 1.5}, "KVQ_HOST_MEM_FRACTION"),
    ("specache", 2, {"recall": 2}, "KVQ_SPECACHE_RECALL"),
])
def test_bad_knobs_are_refused(method, bits, knobs, match):
    """A core knob is a KVQConfig field; a family's own is a field of its parameters (Format.params)."""
    import dataclasses

    from sgl_kvq.formats import registry

    fmt = registry.family(method)
    fields = {f.name for f in dataclasses.fields(fmt.params)} if fmt and fmt.params else set()
    own = {k: v for k, v in knobs.items() if k in fields}
    core = {k: v for k, v in knobs.items() if k not in own}
    with pytest.raises(KVQConfigError, match=match):
        KVQConfig(method, bits, **core, **({"params": fmt.params(**own)} if own else {}))


def test_a_familys_knobs_are_checked_whatever_is_served(monkeypatch):
    """KVQ_* variables reach every process a server spawns: a bad one fails at once, for any dtype."""
    monkeypatch.setenv("KVQ_GEAR_RANK", "0")
    with pytest.raises(KVQConfigError, match="KVQ_GEAR_RANK"):
        parse_kv_cache_dtype("kivi2")


def test_a_family_takes_its_own_parameters_only():
    from sgl_kvq.formats.gear import GearParams
    from sgl_kvq.formats.specache import SpeCacheParams

    assert KVQConfig("kivi", 2).params is None and KVQConfig("specache", 1).params == SpeCacheParams(top_k=128)
    with pytest.raises(KVQConfigError, match="specache2 takes SpeCacheParams, not GearParams"):
        KVQConfig("specache", 2, params=GearParams())
    with pytest.raises(KVQConfigError, match="kivi2 takes no parameters"):
        KVQConfig("kivi", 2, params=GearParams())


def test_a_constraint_of_one_format_binds_only_that_format():
    KVQConfig("kivi", 2, group_size=256, residual=256)  # logquant2's G <= 128 is its own
    KVQConfig("kivi", 2, prefill="paged")  # specache's full-precision prefill is its own


# ---- the config itself ----

def test_knobs_come_from_the_environment_and_each_process_shares_one_config_per_values(monkeypatch):
    monkeypatch.delenv("KVQ_RESIDUAL", raising=False)
    default = parse_kv_cache_dtype("kivi2")
    assert default is parse_kv_cache_dtype("kivi2") and default.residual == 64 and default.ring_pages == 2
    monkeypatch.setenv("KVQ_RESIDUAL", "0")
    windowless = parse_kv_cache_dtype("kivi2")
    assert windowless is not default and windowless.residual == 0 and windowless.ring_pages == 1
    monkeypatch.setenv("KVQ_RESIDUAL", "")  # empty: unset
    assert parse_kv_cache_dtype("kivi2") == default


def test_every_formats_knobs_name_a_config_field_and_reach_it_from_the_environment(monkeypatch):
    """A family's KVQ_* variables are declared by its format (Format.knobs); the config reads them like the core
    ones: each names a field of the family's parameters (Format.params), and setting it changes that field of the
    dtype it belongs to."""
    import dataclasses

    from sgl_kvq.formats import registry

    assert registry.KNOBS, "no format declares a knob"
    for fmt in registry.FORMATS:
        fields = {f.name for f in dataclasses.fields(fmt.params)} if fmt.knobs else set()
        for var, (field, parse) in fmt.knobs.items():
            assert field in fields and var not in env.CORE_KNOBS, (fmt.family, var)
            default = parse_kv_cache_dtype(fmt.dtype_names()[0]).params
            was = getattr(default, field)
            # another valid value: a flag flipped, a count one up, a share of 0.25, the other prefix source
            other = {int: lambda: 1 - was if was in (0, 1) else was + 1, float: lambda: 0.25,
                     str: lambda: "device"}[parse]()
            monkeypatch.setenv(var, str(other))
            assert getattr(parse_kv_cache_dtype(fmt.dtype_names()[0]).params, field) == other != was, \
                (fmt.family, var)
            monkeypatch.delenv(var)


@pytest.mark.parametrize("var,value,match", [
    pytest.param("KVQ_GROUP_SIZE", "sixty-four", "is not a integer", id="not-an-integer"),
    pytest.param("KVQ_OVERLAY_SHARE", "a tenth", "is not a number", id="not-a-number"),
    pytest.param("KVQ_FRAMES", "shared", "KVQ_FRAMES='shared'", id="not-a-choice"),
    pytest.param("KVQ_OVERLAY_SHARE", "1.5", "must be in \\(0, 1\\)", id="out-of-range"),
    pytest.param("KVQ_HOST_MEM_FRACTION", "all", "is not a number", id="format-knob-not-a-number"),
])
def test_a_bad_knob_value_is_refused_by_name(monkeypatch, var, value, match):
    monkeypatch.setenv(var, value)
    with pytest.raises(KVQConfigError, match=match):
        parse_kv_cache_dtype("kivi2")


def test_kvq_dtype_names_and_names_meant_for_sgl_kvq():
    assert is_kvq_dtype("kivi2") and is_kvq_dtype("peer_tq3")
    assert not any(is_kvq_dtype(n) for n in ("bf16", "auto", "fp8_e4m3", None, 2))
    assert looks_like_kvq_dtype("kivi9") and looks_like_kvq_dtype("gear") and not looks_like_kvq_dtype("fp8_e5m2")


@pytest.mark.parametrize("head_dim,match", [(12, "multiple of 8"), (96, "multiple of the value group 64")])
def test_head_dims_the_pages_cannot_hold_are_refused(head_dim, match):
    cfg = KVQConfig("kivi", 2)
    with pytest.raises(KVQConfigError, match=match):
        cfg.check_head_dim(head_dim)
    cfg.check_head_dim(32)  # the value group is clipped to the head dim
    assert cfg.value_group_for(32) == 32 and cfg.value_group_for(128) == 64


def test_the_fingerprint_names_everything_that_changes_stored_pages():
    """KVQConfig.fingerprint (compared across a PD pair, HiCache storage's key): every knob that changes what a page
    or frame holds changes it; one that does not (SpeCache's top-k, the prefill mode) leaves it; a file can be named
    after it."""
    import re
    from dataclasses import replace

    kivi, gear, spec = (parse_kv_cache_dtype(n) for n in ("kivi2", "gear2", "specache1"))
    changed = [replace(kivi, rotate="none"), replace(kivi, group_size=32), replace(kivi, value_group=32),
               replace(kivi, residual=128), parse_kv_cache_dtype("kivi4"), replace(gear, params=replace(gear.params,
               outliers=0.05)), replace(spec, specache_one_bit=False)]
    prints = [c.fingerprint for c in (kivi, gear, spec, *changed)]
    assert len(set(prints)) == len(prints)
    assert replace(kivi, prefill="paged").fingerprint == kivi.fingerprint
    assert replace(spec, params=replace(spec.params, top_k=7)).fingerprint == spec.fingerprint
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", p) for p in prints)
