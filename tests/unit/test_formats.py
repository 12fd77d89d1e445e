"""The format registry (sgl_kvq/formats/) as plain unit tests, no Engine: every dtype name resolves to its format,
each family's knobs are validated by KVQConfig, and the pool's layout, bytes and per-frame state derive from what
the format declares."""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sgl_kvq.config import DTYPE_NAMES, KVQConfig, KVQConfigError, parse_kv_cache_dtype
from sgl_kvq.formats import registry
from sgl_kvq.formats.base import Format
from sgl_kvq.formats.specache import SPECACHE_TOP_K
from sgl_kvq.kernels.format_extras import FORMATS as KERNEL_FORMATS
from sgl_kvq.kv_store import QuantizedKVStore
from sgl_kvq.layout import PoolShape, counts_as_value, kivi_shapes
from sgl_kvq.patches.resolution import check_backend_reads, kvq_backend_for

L, H, D, PAGES = 2, 2, 32, 6


def shape_of(name: str) -> PoolShape:
    return PoolShape(L, H, D, PAGES, parse_kv_cache_dtype(name))


# ---- names ----

def test_every_dtype_name_resolves_to_its_format():
    assert DTYPE_NAMES == ("kivi1", "kivi2", "kivi3", "kivi4", "specache1", "specache2", "gear2", "gearl2",
                           "logquant2", "zipcache2", "peer_fp8_e4m3", "peer_fp4_mx_block16", "peer_nvfp4", "peer_int4",
                           "peer_tq3", "peer_tq4")
    for name in DTYPE_NAMES:
        cfg = parse_kv_cache_dtype(name)
        assert cfg.name == name and cfg.format is registry.family(cfg.method)
        assert name in cfg.format.dtype_names() and cfg.bits in cfg.format.bits


def test_dtype_names_are_unique_and_families_declared_once():
    assert len(set(DTYPE_NAMES)) == len(DTYPE_NAMES)
    assert len(registry.BY_FAMILY) == len(registry.FORMATS)


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


# ---- layout, bytes and state derive from the declaration ----

@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_pool_tensors_are_the_declared_base_plus_the_declared_extras(name):
    shape = shape_of(name)
    fmt, g = shape.cfg.format, shape.geometry
    base = fmt.base_shapes(g, shape.cfg.bits)
    if fmt.kernel is not None:  # what the kernels read
        assert base == kivi_shapes(g, fmt.code_bits(shape.cfg.bits))
    assert {"k_codes", "v_codes"} <= set(base)  # the pooled frames' bytes
    declared = {**base, **fmt.page_shapes(g, **fmt.sizes(shape.cfg, g))}
    assert shape.base_shapes() == {n: ((L, *dims), dt) for n, (dims, dt) in declared.items()}
    if fmt.extras is not None:
        assert tuple(fmt.page_shapes(g, **fmt.sizes(shape.cfg, g))) == fmt.extras._fields


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_bytes_per_token_is_the_declared_tensors(name):
    shape = shape_of(name)
    total = 0.0
    for n, ((_, rows, *rest), dtype) in shape.base_shapes().items():
        per_row = L * math.prod(rest) * dtype.itemsize
        total += per_row / (shape.G if rows == shape.P else 1)
    assert shape.base_bytes_per_token() == pytest.approx(total)


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_store_allocates_the_declaration_and_counts_it(name):
    shape = shape_of(name)
    store = QuantizedKVStore(shape.cfg, shape, 3, torch.float32, "cpu")
    for n, (dims, dtype) in shape.base_shapes().items():
        t = getattr(store, n)
        assert tuple(t.shape) == dims and t.dtype == dtype
    assert store.base_bytes() == sum(math.prod(d) * dt.itemsize for d, dt in shape.base_shapes().values())
    F = store.ov_k.shape[1]
    for n, (dims, dtype) in shape.frame_state_shapes().items():
        assert tuple(getattr(store, n).shape) == (L, F, *dims) and getattr(store, n).dtype == dtype
    assert store.frame_state == tuple(shape.frame_state_shapes())
    view = store.layer_view(0)
    fmt = shape.cfg.format
    assert (view.extras is None) == (fmt.extras is None)
    assert registry.of_extras(view.extras).extras is fmt.extras


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_overlay_bytes_per_frame_counts_the_declared_frame_state(name):
    shape = shape_of(name)
    state = sum(L * math.prod(d) * dt.itemsize for d, dt in shape.frame_state_shapes().values())
    assert shape.overlay_bytes_per_frame(torch.bfloat16) == 2 * L * shape.G * H * D * 2 + 16 + state


def test_kv_split_names():
    assert [counts_as_value(n) for n in ("k_codes", "v_codes", "s_k_codes", "s_v_zero", "v_chan", "s_idx",
                                         "row_off", "ov_score", "ov_k", "ov_v", "v_out_idx")] == \
        [False, True, False, True, True, False, False, False, False, True, True]


def test_every_kernel_format_has_a_kernel_row_and_declared_shapes():
    kernels = {f.kernel for f in registry.FORMATS if f.kernel}
    assert kernels == set(KERNEL_FORMATS) == set(registry.EXTRA_SHAPES)


# ---- a format served only through kvq_torch ----

class _TorchOnly(Format):
    family = "torchonly"
    bits = (2,)
    kernel = None


def test_a_format_without_a_kernel_is_refused_by_kvq_triton():
    cfg = SimpleNamespace(name="torchonly2", format=_TorchOnly())  # what the checks read of a KVQConfig
    with pytest.raises(KVQConfigError, match="no Triton kernel"):
        check_backend_reads(cfg, [("attention-backend", "kvq_triton")])
    check_backend_reads(cfg, [("attention-backend", "kvq_torch"), ("decode-attention-backend", None)])
    assert kvq_backend_for("cuda", cfg) == "kvq_torch"


# ---- nothing outside sgl_kvq/formats/ asks which format it is ----

_IDENTITY = re.compile(r"cfg\.method\b|\.method\s*(==|!=|in\b)|is_specache|is_zipcache|has_correction|has_rows")


def test_no_product_code_tests_a_formats_identity():
    """The product (the package less its tooling, kernels/, patches/) asks the format's declaration, never its
    name; sgl_kvq/formats/ is where the formats are named."""
    root = Path(__file__).resolve().parents[2]
    files = [*(root / "sgl_kvq").rglob("*.py"), *(root / "kernels").rglob("*.py"), *(root / "patches").rglob("*.py")]
    hits = []
    for f in files:
        rel = f.relative_to(root)
        if rel.parts[:2] in {("sgl_kvq", "formats"), ("sgl_kvq", "tools")} or "__pycache__" in rel.parts:
            continue
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if _IDENTITY.search(line):
                hits.append(f"{rel}:{i}: {line.strip()}")
    assert hits == []
