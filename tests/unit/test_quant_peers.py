"""The engines' KV formats (sgl_kvq.formats.peers.reference), KIVI at 3 bits (kivi_bits), bit-stream packing and
rotations.

Round-trip error bounds on random Gaussian K/V, bytes per token at each engine's real layout, SGLang's fp4_mx_block16
quantizer bit for bit, its NVFP4 dequantization, and the rotation algebra the Hadamard KIVI rows rely on.
"""

from __future__ import annotations

import types

import pytest
import torch

from bench.eval import attention
from sgl_kvq.formats.peers import reference as peers
from sgl_kvq.quant import pack
from bench.quant.accounting import bits_per_element, kivi_expected_bits, stored_bytes
from sgl_kvq.quant.bitpack import pack_bits, unpack_bits
from sgl_kvq.quant.compressed import CompressedKV
from bench.quant.kivi import kivi, quantized_len
from bench.quant.kivi_bits import kivi_bits
from sgl_kvq.quant.rotation import hadamard, is_orthogonal, random_orthogonal, rotated, sylvester_hadamard

T, H, D = 512, 2, 64


def _kv(T=T, H=H, D=D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g)


def _err(x_hat, x):
    return float((x_hat - x).norm() / x.norm())


def _table():
    # residual 0: every complete page quantized, so KIVI's rows compare with the window-less peers on equal terms
    return attention.methods(group_size=64, value_group=64, residual=0)


# --- bit-stream packing and KIVI at 3 bits -------------------------------------------------------------------------

@pytest.mark.parametrize("bits", range(1, 9))
def test_bitpack_round_trips_and_is_pack_py_layout_where_both_exist(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 1 << bits, (3, 5, 64), generator=g).to(torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.shape == (3, 5, 64 * bits // 8)
    assert torch.equal(unpack_bits(packed, bits, 64), codes)
    if bits in pack.PACK_BITS and bits != 3:  # pack.py stores 3 bits as two planes, not a stream
        assert torch.equal(packed, pack.pack(codes, bits))


def test_three_bit_codes_are_a_little_endian_stream():
    # vLLM TurboQuant's 3-bit layout: 8 codes -> 24 bits, code i at bit 3i, bytes low first
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]], dtype=torch.uint8)
    word = sum(int(c) << (3 * i) for i, c in enumerate(codes[0]))
    assert pack_bits(codes, 3).tolist() == [[word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF]]
    with pytest.raises(ValueError, match="whole bytes"):
        pack_bits(torch.zeros(1, 4, dtype=torch.uint8), 3)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_kivi_bits_is_kivi_where_kivi_packs(bits):
    k, v = _kv(300, 3, 64)
    a, b = kivi(k, v, bits=bits), kivi_bits(k, v, bits=bits)
    assert torch.equal(a.k_hat, b.k_hat) and torch.equal(a.v_hat, b.v_hat) and torch.equal(a.kept, b.kept)
    assert bits_per_element(a) == bits_per_element(b)


def test_kivi3_bytes_and_error_sit_between_kivi2_and_kivi4():
    T_ = 1536
    k, v = _kv(T_, 3, 64)
    c = kivi_bits(k, v, bits=3)
    n_q = quantized_len(T_, 64, 64)
    assert bits_per_element(c) == pytest.approx(kivi_expected_bits(T_, 3, 64, 64, n_q))
    assert c.stored["k.codes"].shape == (n_q // 64, 64, 3, 24)  # 64 channels x 3 bits = 24 bytes
    errs = {b: _err(kivi_bits(k, v, bits=b).k_hat, k) for b in (2, 3, 4)}
    assert errs[4] < errs[3] < errs[2]


# --- round-trip error of every format ------------------------------------------------------------------------------

# relative error ||x_hat - x|| / ||x|| on N(0, 1) K and V [512, 2, 64]; measured (k / v) about 10% under each bound
BOUNDS = {
    "fp8_e4m3": (0.03, 0.03),  # 0.027 / 0.027
    "fp4_mx_block16": (0.125, 0.125),  # 0.113 / 0.113
    "nvfp4": (0.105, 0.105),  # 0.096 / 0.096
    "nvfp4-gs1": (0.105, 0.105),
    "int4-pth-asym": (0.10, 0.10),  # 0.091 / 0.091
    "int4-pth-sym": (0.12, 0.12),  # 0.108 / 0.107
    "tq3": (0.20, 0.20),  # 0.183 / 0.181
    "tq4": (0.105, 0.105),  # 0.095 / 0.094
    "tq-3bit-nc": (0.20, 0.21),  # 0.183 / 0.192
    "tq-4bit-nc": (0.105, 0.10),  # 0.095 / 0.090
    "tq-k8v4": (0.03, 0.10),  # 0.027 / 0.090
    "kivi4": (0.10, 0.10),  # 0.090 / 0.090
    "kivi3": (0.21, 0.21),  # 0.193 / 0.192
    "kivi2": (0.50, 0.50),  # 0.451 / 0.451
    "kivi3-had": (0.21, 0.21),
    "kivi2-had": (0.50, 0.50),
}


@pytest.fixture(scope="module")
def gaussian_results():
    k, v = _kv()
    q = torch.randn(T, 6, D, generator=torch.Generator().manual_seed(9))
    table = _table()
    out = {}
    for name in BOUNDS:
        c = table[name](k, v, q, D ** -0.5)
        out[name] = (_err(c.k_hat, k), _err(c.v_hat, v), c)
    return out


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_round_trip_error_is_under_its_bound(gaussian_results, name):
    k_err, v_err, c = gaussian_results[name]
    kb, vb = BOUNDS[name]
    assert k_err < kb and v_err < vb, (name, k_err, v_err)
    assert k_err > 1e-3 and v_err > 1e-3  # something was quantized
    assert c.k_hat.shape == c.v_hat.shape == (T, H, D) and c.kept.shape == (T, H)


@pytest.mark.parametrize("four,three", [("tq4", "tq3"), ("tq-4bit-nc", "tq-3bit-nc"), ("kivi4", "kivi3"),
                                        ("kivi3", "kivi2"), ("kivi3-had", "kivi2-had"), ("int4-pth-asym", "tq3")])
def test_more_bits_beat_fewer(gaussian_results, four, three):
    a, b = gaussian_results[four], gaussian_results[three]
    assert a[0] < b[0] and a[1] < b[1]


def test_peers_keep_no_fp16_window(gaussian_results):
    for name in ("fp8_e4m3", "fp4_mx_block16", "nvfp4", "int4-pth-asym", "tq3", "tq-k8v4"):
        assert not gaussian_results[name][2].kept.any()


# --- bytes at the real layouts ---------------------------------------------------------------------------------------

# bytes per token and layer, K + V, at H KV heads of D = 64 (the engines' buffers per (token, head))
PER_TOKEN_HEAD = {
    "fp8_e4m3": 64 + 64,
    "fp4_mx_block16": 2 * (32 + 4),  # packed E2M1 + one uint8 exponent per 16
    "nvfp4": 2 * (32 + 4),  # packed E2M1 + one fp8 scale per 16 (+ 2 x 4 bytes of fp32 global scale per layer)
    "nvfp4-gs1": 2 * (32 + 4),
    "int4-pth-asym": 2 * (32 + 4),  # packed int4 + fp32 scale carrying the zero point
    "int4-pth-sym": 2 * (32 + 4),
    "tq3": 2 * (24 + 2),  # 3-bit indices + fp16 norm
    "tq4": 2 * (32 + 2),
    "tq-3bit-nc": (24 + 2) + (24 + 4),  # vLLM turboquant_3bit_nc: values with fp16 scale + zero
    "tq-4bit-nc": (32 + 2) + (32 + 4),
    "tq-k8v4": 64 + (32 + 4),
}


@pytest.mark.parametrize("name", sorted(PER_TOKEN_HEAD))
def test_bytes_per_token_at_the_real_layout(gaussian_results, name):
    c = gaussian_results[name][2]
    per_layer = 2 * 4 if name.startswith("nvfp4") else 0
    assert stored_bytes(c) == T * H * PER_TOKEN_HEAD[name] + per_layer
    # SmolLM2: 3 KV heads x 64 channels x 30 layers (nvfp4's per-layer global scales add < 1 byte per token here)
    b = bits_per_element(c)
    assert attention.bytes_per_token(b.total, 3, 64, 30) == pytest.approx(30 * 3 * PER_TOKEN_HEAD[name], abs=1)


def test_layouts_are_the_engines_buffers(gaussian_results):
    s = gaussian_results["fp4_mx_block16"][2].stored
    assert s["k.codes"].dtype == torch.uint8 and s["k.codes"].shape == (T, H, D // 2)
    assert s["k.scale"].dtype == torch.uint8 and s["k.scale"].shape == (T, H * D // 16)  # SGLang's flat scale row
    s = gaussian_results["nvfp4"][2].stored
    assert s["k.scale"].dtype == torch.float8_e4m3fn and s["k.scale"].shape == (T, H, D // 16)
    assert s["k.global_scale"].dtype == torch.float32 and s["k.global_scale"].numel() == 1
    s = gaussian_results["int4-pth-asym"][2].stored
    assert s["k.scale"].dtype == torch.float32 and s["k.scale"].shape == (T, H)
    s = gaussian_results["tq-3bit-nc"][2].stored
    assert s["k.codes"].shape == (T, H, 24) and s["k.norm"].dtype == torch.float16
    assert s["v.scale"].dtype == s["v.zero"].dtype == torch.float16
    assert gaussian_results["fp8_e4m3"][2].stored["k.fp8"].dtype == torch.float8_e4m3fn


# --- SGLang, bit for bit ---------------------------------------------------------------------------------------------

def _fp4_inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(257, 3, 64, generator=g) * torch.logspace(-4, 3, 257)[:, None, None]
    x[0] = 0.0  # an all-zero block (scale from the 1e-10 clamp)
    x[1, 0, :16] = 6.0  # amax exactly 6: scale 2**0
    x[2, 1] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25] * 8)  # every E2M1 tie
    x[3, 2] = -x[3, 2].abs()
    return x


@pytest.fixture(scope="module")
def sglang_kvfp4():
    return pytest.importorskip("sglang.srt.layers.quantization.kvfp4_tensor",
                               reason="SGLang is not installed in this environment")


def test_fp4_mx_block16_matches_sglang_compiled(sglang_kvfp4):
    """SGLang's FP4MXBlock16KVQuantizeUtil runs on CPU (its @torch.compile builds an inductor CPU kernel): codes and
    scales equal ours bit for bit on fp32 and bf16 inputs, and its dequantization equals ours."""
    util = sglang_kvfp4.FP4MXBlock16KVQuantizeUtil
    for dtype in (torch.float32, torch.bfloat16):
        x = _fp4_inputs().to(dtype)
        try:
            codes, scale = util.batched_quantize(x)
        except Exception as e:  # pragma: no cover - a machine without a C++ compiler for inductor
            pytest.skip(f"torch.compile of SGLang's quantizer failed on CPU: {type(e).__name__}: {e}")
        mine_codes, mine_scale = peers.fp4_mx_block16_quantize(x)
        assert torch.equal(codes, mine_codes) and torch.equal(scale, mine_scale), dtype
        deq = util.batched_dequantize(codes, scale, dtype=torch.float32)
        assert torch.equal(deq, peers.fp4_mx_block16_dequantize(mine_codes, mine_scale))


def test_fp4_mx_block16_matches_sglang_uncompiled(sglang_kvfp4):
    """The same function without torch.compile (its original Python), on fp32 where it computes what the compiled
    kernel does (on bf16 it rounds intermediates to bf16, which the compiled kernel and ours do not)."""
    util = sglang_kvfp4.FP4MXBlock16KVQuantizeUtil
    fn = getattr(util.batched_quantize, "_torchdynamo_orig_callable", None)
    if fn is None:
        pytest.skip("this torch does not expose the uncompiled function")
    x = _fp4_inputs()
    codes, scale = fn(x)
    mine_codes, mine_scale = peers.fp4_mx_block16_quantize(x)
    assert torch.equal(codes, mine_codes) and torch.equal(scale, mine_scale)


def test_nvfp4_dequantize_matches_sglang_sm90_fallback(sglang_kvfp4, monkeypatch):
    """SGLang's NVFP4 quantize needs FlashInfer on an SM90+ GPU (not runnable here), but its SM90 dequantize is pure
    torch behind a platform check: run it on CPU with the check answering SM90. Its block-scale broadcast works for
    B = M = 1 only ([B, M*N/16, 16] * [B, M, N/16, 1]), so the comparison passes the tensors flattened to one row."""
    monkeypatch.setattr(sglang_kvfp4, "get_platform",
                        lambda: types.SimpleNamespace(is_sm100=False, is_sm120=False, is_sm90=True))
    k, _ = _kv(100, 3, 64)
    for gs in (1.0, float(k.abs().max()) / (6 * 448)):
        codes, sf = peers.nvfp4_quantize(k * 3, gs)
        ref = sglang_kvfp4.NVFP4KVQuantizeUtil.dequantize(codes.reshape(1, 1, -1), sf.reshape(1, 1, -1),
                                                          torch.tensor([gs]), dtype=torch.float32)
        mine = peers.nvfp4_dequantize(codes, sf, gs)
        assert torch.equal(ref.reshape(mine.shape), mine)
    assert peers.E2M1_VALUES == sglang_kvfp4.E2M1_VALUES[:8] and peers.E2M1_BOUNDS == sglang_kvfp4.E2M1_BOUNDS


def test_nvfp4_quantize_is_the_flashinfer_recipe():
    """Line by line: SF = e4m3(amax16 / 6 / gs); every code is the E2M1 value nearest x / (SF * gs), ties to the
    even code, saturating at 6."""
    x = torch.randn(64, 2, 64, generator=torch.Generator().manual_seed(3)) * 5
    gs = float(x.abs().max()) / (6 * 448)
    codes, sf = peers.nvfp4_quantize(x, gs)
    blocks = x.reshape(64, 2, 4, 16)
    want_sf = ((1 / torch.tensor(gs)) * (blocks.abs().amax(-1) * (1 / 6))).to(torch.float8_e4m3fn)
    assert torch.equal(sf.float(), want_sf.float())
    y = blocks / (sf.float().unsqueeze(-1) * gs)
    got = peers._e2m1_decode(pack.unpack(codes, 4)).reshape(y.shape)
    grid = torch.tensor(peers.E2M1_VALUES)
    nearest = (y.abs().clamp(max=6).unsqueeze(-1) - grid).abs().min(-1).values
    assert torch.allclose((got.abs() - y.abs().clamp(max=6)).abs(), nearest, atol=1e-6)
    assert (torch.sign(got) * torch.sign(y) >= 0).all()


def test_e2m1_ties_go_to_the_even_code():
    y = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.75, 0.3])
    assert peers._e2m1_decode(peers.e2m1_round(y)).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0, 0.5]


def test_int4_zero_point_rides_in_the_scale_mantissa():
    k, v = _kv(64, 2, 64)
    c = peers.int4_per_token_head(k, v)
    bits = c.stored["k.scale"].view(torch.int32)
    y = peers.rht(k)
    scale = torch.clamp((y.amax(-1) - y.amin(-1)) / 15, min=1e-6)
    assert torch.equal(bits & -16, scale.view(torch.int32) & -16)
    assert torch.equal((bits & 0xF).float(), torch.clamp(peers._round_half_away(-y.amin(-1) / scale), 0, 15))
    # the randomized Hadamard transform is D times an orthogonal map
    assert torch.allclose(peers.rht(peers.rht(k), inverse=True), 64 * k, atol=1e-4)


def test_lloyd_max_levels_are_the_gaussian_ones():
    # Lloyd-Max for N(0, 1), 3 bits: +-0.2451, 0.7560, 1.3439, 2.1519 (vLLM's 200 iterations stop a little short)
    cent, mids = peers.lloyd_max(64, 3)
    assert torch.allclose(cent * 8, torch.tensor([-2.1519, -1.3439, -0.7560, -0.2451, 0.2451, 0.7560, 1.3439, 2.1519]),
                          atol=3e-3)
    assert torch.allclose(mids, (cent[1:] + cent[:-1]) / 2) and torch.allclose(cent, -cent.flip(0))


# --- rotations -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("d", [1, 2, 16, 64, 128])
def test_rotations_are_orthogonal(d):
    assert is_orthogonal(hadamard(d))
    assert torch.equal(sylvester_hadamard(d).abs(), torch.ones(d, d))
    assert torch.allclose(hadamard(d), hadamard(d).T)
    assert is_orthogonal(random_orthogonal(d, seed=42))
    assert torch.equal(random_orthogonal(d, 42), random_orthogonal(d, 42))
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(48)


@pytest.mark.parametrize("basis", [hadamard, lambda d: random_orthogonal(d, 7)])
def test_rotated_attention_with_output_rotated_back_is_plain_attention(basis):
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(200, 6, 64, generator=g), torch.randn(200, 2, 64, generator=g) * 3, torch.randn(200, 2, 64,
                                                                                                          generator=g)
    r = basis(64)
    plain = attention.causal_attention(q, k, v, 0.125)
    rot = attention.causal_attention(q @ r, k @ r, v @ r, 0.125, chunk=64) @ r.T
    assert torch.allclose(rot, plain, atol=1e-5)

    # the wrapper: a lossless "format" run in the rotated basis gives plain attention back with the original q
    def exact(k_, v_, q_, s):
        return CompressedKV(k_, v_, {"k.x": k_, "v.x": v_}, torch.zeros(k_.shape[:2], dtype=torch.bool))

    c = rotated(exact, basis)(k, v, q, 0.125)
    assert torch.allclose(attention.causal_attention(q, c.k_hat, c.v_hat, 0.125), plain, atol=1e-5)


def test_hadamard_kivi_is_kivi_in_the_rotated_basis():
    k, v = _kv(256, 2, 64)
    r = hadamard(64)
    c = _table()["kivi3-had"](k, v, k[:, :1].repeat(1, 3, 1), 0.125)
    direct = kivi_bits(k @ r, v @ r, bits=3, residual=0)
    assert torch.allclose(c.k_hat @ r, direct.k_hat, atol=1e-5) and torch.allclose(c.v_hat @ r, direct.v_hat, atol=1e-5)
    assert bits_per_element(c) == bits_per_element(direct)
