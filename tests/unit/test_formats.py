"""The format registry (sgl_kvq/formats/) as plain unit tests, no Engine: every dtype name resolves to its format,
each kernel format has its kernel row, a format without a kernel is served by kvq_torch alone, and nothing outside
sgl_kvq/formats/ branches on a format's name. Knob validation is tests/unit/test_config.py's; the layout, bytes and
per-frame state the declarations give, tests/unit/test_layout.py's; the store they allocate,
tests/unit/test_kv_store.py's."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sgl_kvq.config import DTYPE_NAMES, KVQConfigError, parse_kv_cache_dtype
from sgl_kvq.formats import registry
from sgl_kvq.formats.base import Format
from sgl_kvq.patches.resolution import check_backend_reads, kvq_backend_for


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
    names = DTYPE_NAMES + registry.RECIPE_DTYPE_NAMES
    assert len(set(names)) == len(names) and registry.RECIPE_DTYPE_NAMES == ("kivimix",)
    assert len(registry.BY_FAMILY) == len(registry.ALL_FORMATS)


def test_every_kernel_format_declares_shapes_and_reads_its_sizes_back():
    """A format with a kernel declares its page tensors, and reads back off them the sizes the config gave."""
    from sgl_kvq.pool_shape import PoolShape
    from sgl_kvq.kv_store import QuantizedKVStore

    kernels = {f.kernel.name for f in registry.FORMATS if f.kernel and f.kernel.name}
    assert kernels == set(registry.EXTRA_SHAPES)
    for name in DTYPE_NAMES:
        cfg = parse_kv_cache_dtype(name)
        if cfg.format.kernel is None:
            continue
        shape = PoolShape(1, 2, 64, 4, cfg)
        view = QuantizedKVStore(cfg, shape, 2, torch.float32, "cpu").layer_view(0)
        assert cfg.format.kernel.sizes_of(view.extras, shape.geometry) == cfg.format.sizes(cfg, shape.geometry), name


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

_FAMILY = r"(kivi|gear|logquant|zipcache|specache|peer)"
_IDENTITY = re.compile(
    r"cfg\.method\b|\.method\s*(==|!=|in\b)|is_specache|is_zipcache|has_correction|has_rows"
    rf"|(==|!=)\s*[\"']{_FAMILY}|[\"']{_FAMILY}\w*[\"']\s*(==|!=)"  # a name compared with a family's
    rf"|startswith\(\s*[\"']{_FAMILY}|\bin\s*[(\[{{]\s*[\"']{_FAMILY}"  # a name's prefix, a list of names
    rf"|\b(is|has)_{_FAMILY}\b"  # a predicate named after a family
    r"|isinstance\([^)]*\b(PageCorrection|PageRows|SalientPlane|PeerBase)\b")  # a format's tensors' type

_SAMPLES = ['if fmt.family == "gear":', "if cfg.name.startswith('specache'):", 'if name in ("gear2", "gearl2"):',
            "if is_gear(cfg):", "if isinstance(kv.extras, PageCorrection):", "if cfg.method == 'kivi':",
            "if 'zipcache2' != dtype:"]


def test_the_identity_pattern_catches_each_way_of_naming_a_format():
    assert all(_IDENTITY.search(line) for line in _SAMPLES)
    assert not _IDENTITY.search("fmt = registry.BY_NAME[cfg.name]; if fmt.kernel is None: return")


def test_no_product_code_tests_a_formats_identity():
    """The product (sgl_kvq/, kernels/, patches/) asks the format's declaration, never its
    name; sgl_kvq/formats/ is where the formats are named."""
    root = Path(__file__).resolve().parents[2]
    files = [*(root / "sgl_kvq").rglob("*.py"), *(root / "kernels").rglob("*.py"), *(root / "patches").rglob("*.py")]
    hits = []
    for f in files:
        rel = f.relative_to(root)
        if rel.parts[:2] == ("sgl_kvq", "formats") or "__pycache__" in rel.parts:
            continue
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if _IDENTITY.search(line):
                hits.append(f"{rel}:{i}: {line.strip()}")
    assert hits == []
