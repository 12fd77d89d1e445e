"""The kernels' format extras group (kernels/format_extras.py) against the layout the pool allocates: the tensors the
kernels read by name are the ones each format declares (formats.registry.EXTRA_SHAPES), and the sizes read off a
pool's layer view are the ones PoolShape takes from the config (ZipCache's salient width included). Reading them is
checked by the kernel-vs-reference tests (tests/kernels/test_kernels_attention.py)."""

from __future__ import annotations

import re

import pytest
import torch

from sgl_kvq.config import parse_kv_cache_dtype
from sgl_kvq.errors import LayoutError
from sgl_kvq.formats.registry import EXTRA_SHAPES
from sgl_kvq.kernels.checks import layer_geometry
from sgl_kvq.kernels.format_extras import format_extras
from sgl_kvq.kv_store import QuantizedKVStore
from sgl_kvq.plan import LayerKV
from sgl_kvq.pool_shape import PoolShape
from sgl_kvq.formats.gear.codec import PageCorrection
from sgl_kvq.formats.logquant.codec import PageRows
from sgl_kvq.formats.zipcache.codec import SalientPlane

H, D, PAGES = 2, 32, 5


def layer_view(dtype_name: str) -> tuple[LayerKV, PoolShape]:
    cfg = parse_kv_cache_dtype(dtype_name)
    shape = PoolShape(1, H, D, PAGES, cfg)
    return QuantizedKVStore(cfg, shape, 2, torch.float32, "cpu").layer_view(0), shape


@pytest.mark.parametrize("name,fields", [("gear", PageCorrection._fields), ("logquant", PageRows._fields),
                                         ("zipcache", SalientPlane._fields)])
def test_declared_tensors_are_the_named_tuple_the_kernels_read(name, fields):
    g = PoolShape(1, H, D, PAGES, parse_kv_cache_dtype("kivi2")).geometry
    sizes = {"gear": dict(rank=2, nk=1, nv=1), "logquant": dict(rows=3), "zipcache": dict(salient=4, salient_bits=4)}
    assert tuple(EXTRA_SHAPES[name](g, **sizes[name])) == fields


@pytest.mark.parametrize("dtype_name", ["gear2", "gearl2", "logquant2", "zipcache2"])
def test_sizes_read_off_the_view_are_the_configs(dtype_name):
    kv, shape = layer_view(dtype_name)
    extras, consts = format_extras(kv, layer_geometry(kv))
    kind, sizes = shape.format_sizes()
    correct_k, correct_v = shape.cfg.format.kernel.corrections()
    assert consts == dict(CORRECT=(correct_k, correct_v), SIZES=tuple(sizes.values()))
    assert correct_k.__name__ == f"_{kind}_kt" and correct_v.__name__ == f"_{kind}_v"
    assert type(extras).__name__ in ("PageCorrection", "PageRows", "SalientPlane")
    assert all(t.numel() > 0 for t in extras)  # gearl2's empty outlier tensors are passed as a stand-in


@pytest.mark.parametrize("dtype_name,field,bad,why", [("gear2", "k_u", 0, "rank >= 1"),
                                                      ("zipcache2", "s_idx", 0, "1..G-1 salient"),
                                                      ("zipcache2", "s_idx", 64, "1..G-1 salient")])
def test_sizes_out_of_the_corrections_bounds_are_refused(dtype_name, field, bad, why):
    """Each format reads its sizes off the view (KernelVariant.sizes_of) and refuses those its kernel correction cannot
    read, before any launch (rank 0; no salient token, or a whole page of them at G = 64)."""
    kv, _ = layer_view(dtype_name)
    t = getattr(kv.extras, field)
    dim = 2 if field == "k_u" else t.dim() - 1
    kv.extras = kv.extras._replace(**{field: t.narrow(dim, 0, 0) if bad == 0 else
                                      torch.zeros(*t.shape[:dim], bad, dtype=t.dtype)})
    with pytest.raises(LayoutError, match=f"sgl_kvq kernels: .*{re.escape(why)}"):
        format_extras(kv, layer_geometry(kv))


def test_zipcache_salient_width_is_the_configs():
    kv, shape = layer_view("zipcache2")
    _, consts = format_extras(kv, layer_geometry(kv))
    assert consts["SIZES"][1] == shape.format_sizes()[1]["salient_bits"]


@pytest.mark.parametrize("dtype_name", ["kivi1", "kivi2", "kivi4", "specache2"])
def test_plain_kivi_pages_have_no_extras(dtype_name):
    kv, _ = layer_view(dtype_name)
    from sgl_kvq.formats.plain_kernel import _plain_kt, _plain_v

    assert format_extras(kv, layer_geometry(kv)) == ((), dict(CORRECT=(_plain_kt, _plain_v), SIZES=()))


def test_one_format_per_view():
    """A view holds one extras tuple (LayerKV.extras), so two formats' extras cannot meet; a tuple that no format
    declares is refused."""
    kv, _ = layer_view("gear2")
    kv.extras = tuple(kv.extras)
    with pytest.raises(ValueError, match="no format declares"):
        format_extras(kv, layer_geometry(kv))
