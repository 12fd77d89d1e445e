"""The peers' KV formats as served formats (sgl_kvq/formats/peers/), no Engine: pages written through the store
read back what the references (sgl_kvq/formats/peers/reference.py) store and rebuild, bit for bit, on odd shapes; the
open page reads as the packed page will; bytes per token are the peers' layouts; kvq_triton refuses them; their config
is validated; the served fp4_mx_block16 equals SGLang's own quantizer."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from sgl_kvq.config import KVQConfigError, parse_kv_cache_dtype
from sgl_kvq.formats import peers as peer_formats
from sgl_kvq.kv_store import QuantizedKVStore
from sgl_kvq.patches.resolution import check_backend_reads, kvq_backend_for
from sgl_kvq.pool_shape import PoolShape
from sgl_kvq.formats.peers import reference as ref

PEERS = {  # dtype name -> the reference it serves
    "peer_fp8_e4m3": ref.fp8_e4m3,
    "peer_fp4_mx_block16": ref.fp4_mx_block16,
    "peer_nvfp4": lambda k, v: ref.nvfp4(k, v, global_scale=1.0),  # SGLang's without calibrated KV scales
    "peer_int4": ref.int4_per_token_head,
    "peer_tq3": lambda k, v: ref.turboquant_preset(k, v, "turboquant_3bit_nc"),
    "peer_tq4": lambda k, v: ref.turboquant_preset(k, v, "turboquant_4bit_nc"),
}
# the reference's stored names -> the pool's (per token slot)
STORED = {"k.fp8": "k_codes", "v.fp8": "v_codes", "k.codes": "k_codes", "v.codes": "v_codes", "k.scale": "k_scale",
          "v.scale": "v_scale", "k.norm": "k_norm", "v.zero": "v_zero"}
SHAPES = [(8, 1, 32), (16, 3, 64), (32, 2, 128)]  # (G, H, D)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _store(name: str, G: int, H: int, D: int, pages: int, model_dtype=torch.float32):
    cfg = parse_kv_cache_dtype(name)
    cfg = dataclasses.replace(cfg, group_size=G)
    shape = PoolShape(2, H, D, pages, cfg)
    return QuantizedKVStore(cfg, shape, 3, model_dtype, "cpu"), cfg


@pytest.mark.parametrize("G,H,D", SHAPES)
@pytest.mark.parametrize("name", PEERS)
def test_pages_written_read_back_the_reference(name, G, H, D):
    """Random K/V with outliers, pages written in shuffled order on layer 1: the pool holds the reference's stored
    tensors bit for bit and reads back its k_hat / v_hat exactly."""
    store, cfg = _store(name, G, H, D, 7)
    gen = torch.Generator().manual_seed(G + H + D)
    n = 5
    k = torch.randn(n, G, H, D, generator=gen) * 2
    v = torch.randn(n, G, H, D, generator=gen)
    k[:, :, :, 3] *= 30  # an outlier channel
    v[0, 0] = 0  # an all-zero row
    pages = torch.tensor(random.Random(D).sample(range(1, 8), n))
    store.store_pages(1, pages, k, v)
    r = PEERS[name](k.reshape(-1, H, D), v.reshape(-1, H, D))
    slots = (pages[:, None] * G + torch.arange(G)).reshape(-1)
    for ref_name, t in r.stored.items():
        if ref_name.endswith("global_scale"):  # a constant 1.0, no pool bytes
            assert float(t) == 1.0
            continue
        got = getattr(store, STORED[ref_name])[1, slots]
        assert torch.equal(_bits(got), _bits(t.reshape(got.shape))), ref_name
    kh, vh = cfg.format.codec.read_pages(store.layer_view(1), pages)
    assert torch.equal(kh.reshape(-1, H, D), r.k_hat) and torch.equal(vh.reshape(-1, H, D), r.v_hat)


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", PEERS)
def test_the_open_page_reads_as_its_packed_page_will(name, model_dtype):
    """Every token is read quantized: the overlay frame's tokens through the format's quantizer give what the
    page reads once packed from the same frame."""
    G, H, D = 16, 2, 64
    store, cfg = _store(name, G, H, D, 4, model_dtype)
    frame = (torch.randn(1, G, H, D) * 3).to(model_dtype)
    store.store_pages(0, torch.tensor([2]), frame, -frame)
    kv = store.layer_view(0)
    kp, vp = cfg.format.codec.read_pages(kv, torch.tensor([2]))
    ko, vo = cfg.format.codec.read_overlay(frame[0], -frame[0])
    torch.testing.assert_close(ko, kp[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(vo, vp[0], rtol=0, atol=1e-6)
    assert not torch.equal(ko, frame[0].float())  # quantized, not the fp16 token


# bytes per (token, KV head, layer) at the peers' real layouts, head_dim D
LAYOUT = {
    "peer_fp8_e4m3": lambda D: 2 * D,  # one fp8 byte per element
    "peer_fp4_mx_block16": lambda D: 2 * (D // 2 + D // 16),  # E2M1 nibbles + a uint8 exponent per 16
    "peer_nvfp4": lambda D: 2 * (D // 2 + D // 16),  # E2M1 nibbles + an fp8 scale per 16 (global: per layer)
    "peer_int4": lambda D: 2 * (D // 2 + 4),  # nibbles + an fp32 scale with the zero point inside
    "peer_tq3": lambda D: (3 * D // 8 + 2) + (3 * D // 8 + 4),  # key codes + fp16 norm, value codes + scale, zero
    "peer_tq4": lambda D: (D // 2 + 2) + (D // 2 + 4),
}


@pytest.mark.parametrize("name", PEERS)
def test_bytes_per_token_are_the_peers_layout(name):
    L, H, D, T = 30, 3, 64, 64  # SmolLM2's KV geometry
    shape = PoolShape(L, H, D, 8, parse_kv_cache_dtype(name))
    assert shape.base_bytes_per_token() == L * H * LAYOUT[name](D)
    # and what the reference stores, per token (its global scales are per layer)
    r = PEERS[name](torch.randn(T, H, D), torch.randn(T, H, D))
    per_token = sum(t.numel() * t.element_size() for n, t in r.stored.items() if not n.endswith("global_scale")) / T
    assert shape.base_bytes_per_token() == L * per_token
    assert 2 * L * H * D * 2 / shape.base_bytes_per_token() == pytest.approx(BF16_RATIO[name], abs=0.01)


BF16_RATIO = {"peer_fp8_e4m3": 2.0, "peer_fp4_mx_block16": 3.56, "peer_nvfp4": 3.56, "peer_int4": 3.56,
              "peer_tq3": 4.74, "peer_tq4": 3.66}  # bf16's bytes per token over the peer's, at D = 64


@pytest.mark.parametrize("name", PEERS)
def test_kvq_triton_refuses_the_peers_before_the_model_loads(name):
    cfg = parse_kv_cache_dtype(name)
    with pytest.raises(KVQConfigError, match=f"sgl_kvq: {name} has no Triton kernel; --attention-backend "
                                             "kvq_triton cannot serve it, use kvq_torch"):
        check_backend_reads(cfg, [("attention-backend", "kvq_triton")])
    check_backend_reads(cfg, [("attention-backend", "kvq_torch")])
    assert kvq_backend_for("cuda", cfg) == "kvq_torch"


def test_peer_config():
    for name in PEERS:
        cfg = parse_kv_cache_dtype(name)
        assert cfg.name == name and cfg.residual == 0 and cfg.ring_pages == 1  # no fp16 window
        assert cfg.format.kernel is None and not cfg.format.codec.plain_pages
    for name in ("peer_fp4_mx_block16", "peer_nvfp4"):
        with pytest.raises(KVQConfigError, match="blocks of 16"):
            parse_kv_cache_dtype(name).check_head_dim(40)
    parse_kv_cache_dtype("peer_int4").check_head_dim(64)
    with pytest.raises(KVQConfigError, match="cannot be packed at 3 bit"):
        parse_kv_cache_dtype("peer_tq3").check_head_dim(12)
    with pytest.raises(KVQConfigError, match="unknown kv cache dtype"):
        parse_kv_cache_dtype("peer_tq5")


def test_a_peer_refuses_kvqs_rotation(monkeypatch):
    """KVQ_ROTATE would add our rotation to the peer's arithmetic: refused by name, whatever the peer; the peers
    default to none."""
    assert {parse_kv_cache_dtype(name).rotate for name in PEERS} == {"none"}
    monkeypatch.setenv("KVQ_ROTATE", "values")
    for name in PEERS:
        with pytest.raises(KVQConfigError, match=f"{name} is the peer's own arithmetic.*Unset KVQ_ROTATE"):
            parse_kv_cache_dtype(name)


def test_frames_pool_even_where_a_row_is_no_whole_number_of_code_rows():
    from sgl_kvq.frames import can_pool

    int4, tq3 = (PoolShape(2, 2, 64, 8, parse_kv_cache_dtype(n)) for n in ("peer_int4", "peer_tq3"))
    assert can_pool(int4, torch.bfloat16) and int4.pages_per_frame(torch.bfloat16) == 4
    # a bf16 row of 64 channels is 128 bytes over 24-byte rows of 3-bit codes: 6 pages a frame, 5.33 of them used
    assert can_pool(tq3, torch.bfloat16) and tq3.pages_per_frame(torch.bfloat16) == 6


def test_each_peer_names_its_format_by_its_extras():
    from sgl_kvq.formats import registry

    types = {f.extras for f in peer_formats.FORMATS}
    assert len(types) == len(peer_formats.FORMATS)
    for f in peer_formats.FORMATS:
        assert registry.of_extras(f.extras(*(torch.zeros(1) for _ in f.extras._fields))) is f


def test_served_fp4_mx_block16_is_sglangs_quantizer():
    """SGLang's FP4MXBlock16KVQuantizeUtil on this CPU (its original Python, which on fp32 computes what its
    compiled kernel does; tests/unit/test_quant_peers.py compares the compiled one with the reference): the pool's codes
    and scales of a KV [T, H, D] equal its batched_quantize's bit for bit."""
    kvfp4 = pytest.importorskip("sglang.srt.layers.quantization.kvfp4_tensor")
    fn = getattr(kvfp4.FP4MXBlock16KVQuantizeUtil.batched_quantize, "_torchdynamo_orig_callable", None)
    if fn is None:
        pytest.skip("this torch does not expose the uncompiled function")
    G, H, D = 16, 3, 64
    store, cfg = _store("peer_fp4_mx_block16", G, H, D, 4)
    k = torch.randn(2, G, H, D) * 4
    k[0, 1, 2, :16] = 0
    store.store_pages(0, torch.tensor([3, 1]), k, k)
    slots = (torch.tensor([3, 1])[:, None] * G + torch.arange(G)).reshape(-1)
    codes, scale = fn(k.reshape(-1, H, D))  # [T, H, D / 2], [T, H * D / 16]
    assert torch.equal(store.k_codes[0, slots], codes)
    assert torch.equal(store.k_scale[0, slots].reshape(len(slots), -1), scale)
    assert math.prod(scale.shape) == len(slots) * H * D // 16
