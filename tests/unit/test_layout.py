"""sgl_kvq/layout.py: a pool's tensors, bytes per token and per-frame bytes are what the served format declares."""

from __future__ import annotations

import math

import pytest
import torch

from sgl_kvq.config import DTYPE_NAMES, parse_kv_cache_dtype
from sgl_kvq.layout import counts_as_value, frame_of, kivi_shapes
from sgl_kvq.pool_shape import PoolShape

L, H, D, PAGES = 2, 2, 32, 6


def shape_of(name: str) -> PoolShape:
    return PoolShape(L, H, D, PAGES, parse_kv_cache_dtype(name))


# ---- layout, bytes and state derive from the declaration ----

@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_pool_tensors_are_the_declared_base_plus_the_declared_extras(name):
    shape = shape_of(name)
    fmt, g = shape.cfg.format, shape.geometry
    base = fmt.base_shapes(g, shape.cfg.bits)
    if fmt.kernel is not None:  # what the kernels read
        assert base == kivi_shapes(g, shape.cfg.bits)
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
def test_overlay_bytes_per_frame_counts_the_declared_frame_state(name):
    shape = shape_of(name)
    state = sum(L * math.prod(d) * dt.itemsize for d, dt in shape.frame_state_shapes().values())
    assert shape.overlay_bytes_per_frame(torch.bfloat16) == 2 * L * shape.G * H * D * 2 + 16 + state


def test_kv_split_names():
    assert [counts_as_value(n) for n in ("k_codes", "v_codes", "s_k_codes", "s_v_zero", "v_chan", "s_idx",
                                         "row_off", "ov_score", "ov_k", "ov_v", "v_out_idx")] == \
        [False, True, False, True, True, False, False, False, False, True, True]


def test_kivi2_bytes_per_token_by_hand():
    """2 layers x 2 KV heads x D 32 at G 64 (the value group clipped to 32): per layer and head, 8 B of key codes and
    8 of value codes per token, the keys' fp16 scale and zero per page and channel (2 x 32 x 2 B / 64 tokens = 2 B)
    and the values' per token and group (2 x 1 x 2 B = 4 B): 22 B, 88 B a token where bf16's K and V take 512."""
    shape = shape_of("kivi2")
    assert shape.base_bytes_per_token() == 88
    assert 2 * L * H * D * 2 / shape.base_bytes_per_token() == pytest.approx(5.818, abs=1e-3)


def test_frame_of_gives_each_request_slot_ring_frames_in_turn():
    assert [frame_of(3, lpage, 2) for lpage in range(5)] == [6, 7, 6, 7, 6]
    slots, lpages = torch.tensor([[0], [1]]), torch.tensor([[0, 1, 2]])
    assert frame_of(slots, lpages, 3).tolist() == [[0, 1, 2], [3, 4, 5]]


# SmolLM2-135M's packed bytes per token (30 layers, 3 KV heads, head_dim 64, the default knobs), as the README's dtype
# tables state them: a refactor of the formats must leave every one unchanged.
SMOLLM2_BYTES_PER_TOKEN = {
    "kivi1": 2160, "kivi2": 3600, "kivi3": 5040, "kivi4": 6480, "specache1": 2160, "specache2": 3600,
    "gear2": 5580, "gearl2": 5040, "logquant2": 3960.46875, "zipcache2": 6662.8125, "peer_fp8_e4m3": 11520,
    "peer_fp4_mx_block16": 6480, "peer_nvfp4": 6480, "peer_int4": 6480, "peer_tq3": 4860, "peer_tq4": 6300,
}


def test_every_dtype_has_its_pinned_smollm2_bytes_per_token():
    assert set(SMOLLM2_BYTES_PER_TOKEN) == set(DTYPE_NAMES), "pin the new dtype's bytes per token here"
    got = {n: PoolShape(30, 3, 64, PAGES, parse_kv_cache_dtype(n)).base_bytes_per_token() for n in DTYPE_NAMES}
    assert got == pytest.approx(SMOLLM2_BYTES_PER_TOKEN)
