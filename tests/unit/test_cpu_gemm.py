"""patches/cpu_gemm.py: a bf16 linear of two rows or more computed in fp32 equals torch's bf16 GEMM to within one
bf16 rounding; one row, other dtypes and KVQ_CPU_GEMM=native keep SGLang's own path; a bad KVQ_CPU_GEMM is refused
with the values that work. The engine tests run through the hook on every machine where it is on (env.cpu_gemm_mode)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sgl_kvq import env
from sgl_kvq.errors import KVQConfigError
from sgl_kvq.patches import cpu_gemm


class Layer(torch.nn.Module):
    def __init__(self, out_features: int, in_features: int, dtype=torch.bfloat16):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(out_features, in_features, dtype=dtype), requires_grad=False)


@pytest.fixture
def mode(monkeypatch):
    def set_mode(value: str):
        monkeypatch.setenv("KVQ_CPU_GEMM", value)
        cpu_gemm._mode.cache_clear()
    yield set_mode
    cpu_gemm._mode.cache_clear()


@pytest.mark.parametrize("rows,out_features,in_features", [(2, 64, 32), (7, 100, 576), (33, 1, 17), (5, 49152, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_linear_is_the_bf16_gemm_within_one_rounding(rows, out_features, in_features, bias, mode):
    mode("fp32")
    torch.manual_seed(rows * out_features + in_features)
    layer = Layer(out_features, in_features)
    x = torch.randn(rows, in_features, dtype=torch.bfloat16)
    b = torch.randn(out_features, dtype=torch.bfloat16) if bias else None
    calls = []
    out = cpu_gemm.linear_apply(lambda *a: calls.append(a), None, layer, x, b)
    assert not calls and out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    exact = F.linear(x.double(), layer.weight.double(), None if b is None else b.double())
    ulp = exact.abs().float().clamp_min(1e-3) * 2.0 ** -7  # one bf16 step at the result's size
    assert ((out.double() - exact).abs() <= ulp).all()
    native = F.linear(x, layer.weight, b)
    assert (out != native).float().mean() < 0.01  # the two roundings disagree only on near-ties


def test_one_row_other_dtypes_and_native_mode_keep_sglangs_path(mode):
    def orig(*args):
        return "sglang"

    layer = Layer(8, 16)
    mode("fp32")
    assert cpu_gemm.linear_apply(orig, None, layer, torch.randn(1, 16, dtype=torch.bfloat16)) == "sglang"
    assert cpu_gemm.linear_apply(orig, None, layer, torch.randn(1, 1, 16, dtype=torch.bfloat16)) == "sglang"
    assert cpu_gemm.linear_apply(orig, None, Layer(8, 16, torch.float32), torch.randn(4, 16)) == "sglang"
    assert cpu_gemm.linear_apply(orig, None, layer, torch.randn(2, 3, 16, dtype=torch.bfloat16)).shape == (2, 3, 8)
    mode("native")
    assert cpu_gemm.linear_apply(orig, None, layer, torch.randn(4, 16, dtype=torch.bfloat16)) == "sglang"


def test_the_fp32_copy_is_made_once_per_weight_and_again_after_an_update(mode):
    mode("fp32")
    layer = Layer(8, 16)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    cpu_gemm.linear_apply(None, None, layer, x)
    copy = cpu_gemm._fp32(layer.weight)
    cpu_gemm.linear_apply(None, None, layer, x)
    assert cpu_gemm._fp32(layer.weight) is copy and copy.dtype == torch.float32
    with torch.no_grad():
        layer.weight.copy_(torch.ones_like(layer.weight))  # a weight update in place
    out = cpu_gemm.linear_apply(None, None, layer, x)
    torch.testing.assert_close(out, F.linear(x.float(), torch.ones(8, 16)).bfloat16())


def test_a_bad_mode_is_refused_with_the_values_that_work(monkeypatch):
    monkeypatch.setenv("KVQ_CPU_GEMM", "bf16")
    with pytest.raises(KVQConfigError, match="KVQ_CPU_GEMM='bf16'.*fp32, native"):
        env.cpu_gemm_mode()
    monkeypatch.delenv("KVQ_CPU_GEMM")
    assert env.cpu_gemm_mode() in env.CPU_GEMM_MODES


def test_the_lm_head_of_a_plain_tied_embedding_runs_in_fp32(mode):
    """SGLang's _compute_lm_head as the logits processor calls it (an `out` buffer it only uses on CUDA); a
    quantized head and one-row calls keep SGLang's path."""
    from types import SimpleNamespace

    from sglang.srt.layers.quantization.unquant import UnquantizedEmbeddingMethod

    mode("fp32")
    head = SimpleNamespace(weight=torch.randn(300, 32, dtype=torch.bfloat16),
                           quant_method=UnquantizedEmbeddingMethod())
    processor = SimpleNamespace(use_fp32_lm_head=False, use_fp32_lm_head_output=False)
    hidden = torch.randn(5, 32, dtype=torch.bfloat16)

    def orig(*args, **kwargs):
        return "sglang"

    logits = cpu_gemm.compute_lm_head(orig, processor, hidden, head, None, out=None)
    assert logits.shape == (5, 300) and logits.dtype == torch.bfloat16
    assert isinstance(cpu_gemm.compute_lm_head(orig, processor, hidden, head, None, out=torch.empty(5, 300)),
                      torch.Tensor)
    assert cpu_gemm.compute_lm_head(orig, processor, hidden[:1], head, None, out=None) == "sglang"
    tied = SimpleNamespace(weight=head.weight, quant_method=None)  # Gemma 3's tied head
    assert isinstance(cpu_gemm.compute_lm_head(orig, processor, hidden, tied, None, out=None), torch.Tensor)
    quantized = SimpleNamespace(weight=head.weight, quant_method=object())
    assert cpu_gemm.compute_lm_head(orig, processor, hidden, quantized, None, out=None) == "sglang"
