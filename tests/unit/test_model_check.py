"""sgl_kvq/model_check.py: which models a kvq dtype serves, judged from the config before any weight loads.
Sliding-window layers are served by every dtype (both backends mask every path by the window, SpeCache's lanes
included); SGLang's hybrid SWA pools are refused with the reason and what would work."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config

from sgl_kvq.config import KVQConfigError, parse_kv_cache_dtype
from sgl_kvq.model_check import check_hf_config, has_sliding_windows

GEMMA3 = Gemma3TextConfig(num_hidden_layers=6, sliding_window=512, head_dim=256, num_key_value_heads=1,
                          architectures=["Gemma3ForCausalLM"])
LLAMA = LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, architectures=["LlamaForCausalLM"])


def test_which_configs_have_sliding_windows():
    assert has_sliding_windows(GEMMA3) and "sliding_attention" in GEMMA3.layer_types
    assert has_sliding_windows(MistralConfig(sliding_window=4096))
    assert not has_sliding_windows(LLAMA)
    assert not has_sliding_windows(Qwen2Config(sliding_window=4096, use_sliding_window=False))


@pytest.mark.parametrize("dtype", ["kivi2", "kivi4", "gear2", "logquant2", "zipcache2", "peer_int4", "specache1",
                                   "specache2"])
def test_sliding_window_models_are_served(dtype):
    check_hf_config(GEMMA3, parse_kv_cache_dtype(dtype))
    check_hf_config(LLAMA, parse_kv_cache_dtype(dtype))


@pytest.mark.parametrize("config,dtype,hybrid,message", [
    (GEMMA3, "specache2", True, "pass --disable-hybrid-swa-memory"),
    (GEMMA3, "kivi2", True, "pass --disable-hybrid-swa-memory"),
    (SimpleNamespace(architectures=["Lin"], layer_types=["full_attention", "linear_attention"], head_dim=64),
     "kivi2", False, "mixes attention kinds ['full_attention', 'linear_attention']"),
    (SimpleNamespace(architectures=["DeepseekV3ForCausalLM"], kv_lora_rank=512, head_dim=64), "kivi2", False,
     "multi-head latent attention"),
])
def test_what_is_refused_names_the_cause_and_what_works(config, dtype, hybrid, message):
    with pytest.raises(KVQConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        check_hf_config(config, parse_kv_cache_dtype(dtype), hybrid_swa=hybrid)
