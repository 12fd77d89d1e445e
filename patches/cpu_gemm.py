"""bf16 GEMMs of the CPU engine in fp32 where the CPU has no bf16 matrix instructions (KVQ_CPU_GEMM, env.cpu_gemm_mode).

On an AVX2 machine torch's bf16 GEMM falls back to a scalar loop: 0.2 GFLOP/s against 28 for fp32 on one core
(docs/development.md, CPU development environment), so a prefill's linears and the lm_head of a logprob request
dominate every engine run, bf16's and every kvq dtype's alike. Under "fp32" a bf16 linear of two rows or more
multiplies the bf16 activations (widened exactly) by a cached fp32 copy of the weight and rounds the result to bf16:
what a native bf16 GEMM computes (fp32 accumulation), up to summation order. One row (a batch-1 decode step) keeps
torch's bf16 GEMV, which reads half the bytes and is as fast. Nothing changes on a GPU or for non-bf16 models.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from sgl_kvq import env

_FP32_WEIGHTS: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}  # id(weight) -> (weight, version, fp32 copy)


@functools.cache
def _mode() -> str:
    return env.cpu_gemm_mode()  # read once per process: /proc/cpuinfo and KVQ_CPU_GEMM


def _in_fp32(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (_mode() == "fp32" and x.device.type == "cpu" and x.dtype == torch.bfloat16
            and weight.dtype == torch.bfloat16 and x.dim() >= 2 and x.numel() // x.shape[-1] >= 2)


def _fp32(weight: torch.Tensor) -> torch.Tensor:
    """The weight in fp32, made again only when the weight is written in place (SGLang's weight updates: torch's
    version counter); the cache holds the weight itself so its id is not reused."""
    held = _FP32_WEIGHTS.get(id(weight))
    if held is None or held[0] is not weight or held[1] != weight._version:
        held = _FP32_WEIGHTS[id(weight)] = (weight, weight._version, weight.detach().float())
    return held[2]


def linear_fp32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    out = F.linear(x.float(), _fp32(weight), None if bias is None else bias.float())
    return out.to(x.dtype)


def linear_apply(orig, self, layer, x, bias=None, *args, **kwargs):
    """UnquantizedLinearMethod.apply: the model's linears."""
    if not args and not kwargs and _in_fp32(x, layer.weight):
        return linear_fp32(x, layer.weight, bias)
    return orig(self, layer, x, bias, *args, **kwargs)


def compute_lm_head(orig, self, hidden_states, lm_head, embedding_bias=None, *args, **kwargs):
    """LogitsProcessor._compute_lm_head: the vocabulary projection (Gemma 3's: 262,144 x 640, tied to the
    embedding, no quant_method), for every prompt token of a request that asks for input logprobs. SGLang's own
    path for a plain weight is `hidden_states @ weight.T` in the weight's dtype (its `out` buffer serves the CUDA
    fp32 path alone); a quantized or LoRA lm_head keeps its own."""
    weight = getattr(lm_head, "weight", None)
    if (not args and set(kwargs) <= {"out"} and embedding_bias is None and weight is not None
            and type(getattr(lm_head, "quant_method", None)).__name__ in ("NoneType", "UnquantizedEmbeddingMethod")
            and not hasattr(lm_head, "set_lora") and not self.use_fp32_lm_head
            and not getattr(self, "use_fp32_lm_head_output", False)
            and _in_fp32(hidden_states, weight)):
        return linear_fp32(hidden_states, weight)
    return orig(self, hidden_states, lm_head, embedding_bias, *args, **kwargs)
