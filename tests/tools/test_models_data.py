"""Embedded models (bench.models) and data (bench.data): built offline from installed packages, sane
content."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from sgl_kvq import env
from bench import data


def _slow_unless_built(name: str):
    """The first SmolLM2 build dequantizes the GGUF (~1 min); later runs read the cached folder."""
    built = (env.cache_dir() / "models" / name / ".complete").exists()
    return (lambda f: f) if built else pytest.mark.slow


def test_model_tiny_cli_prints_a_folder_transformers_loads(venv_bin):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = subprocess.run([str(venv_bin / "sgl-kvq"), "model", "tiny"], capture_output=True, text=True, check=True)
    folder = Path(out.stdout.strip().splitlines()[-1])
    assert (folder / ".complete").exists()
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    ids = tok("def main():\n    return 0\n", return_tensors="pt").input_ids
    assert tok.decode(ids[0]) == "def main():\n    return 0\n"  # byte-level BPE round-trips exactly
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (2, 4, 2, 16)


@_slow_unless_built("smollm2-135m-instruct")
def test_smollm2_folder_is_bf16_llama_with_gqa():
    from safetensors import safe_open
    from transformers import AutoTokenizer

    from bench.models import smollm2

    folder = smollm2()
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (30, 9, 3)
    assert cfg["head_dim"] == 64 == cfg["hidden_size"] // cfg["num_attention_heads"]
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    assert "quantization_config" not in cfg
    files = sorted(folder.glob("*.safetensors"))
    assert files
    n_params, dtypes = 0, set()
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                t = st.get_slice(name)
                dtypes.add(t.get_dtype())
                n_params += torch.Size(t.get_shape()).numel()
    assert dtypes == {"BF16"}
    assert 130e6 < n_params < 140e6  # 134.5M with tied embeddings stored once
    tok = AutoTokenizer.from_pretrained(folder)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert "Hi" in prompt and prompt.rstrip().endswith("assistant")


def test_essays_are_paul_graham_text():
    texts = data.essays()
    assert len(texts) >= 40
    assert sorted(map(len, texts))[len(texts) // 2] > 5_000  # median essay; a few are one-liners (rss.txt)
    assert data.essays() == texts  # stable order
    joined = data.essay_text()
    assert len(joined) > 500_000 and "startup" in joined
    head = data.essay_text(min_chars=20_000)
    assert 20_000 <= len(head) < len(joined) and joined.startswith(head)


def test_held_out_essays_are_past_what_the_default_ppl_text_reads():
    held = data.held_out_essay_text()
    joined = data.essay_text()
    # the default run reads the first 4,609 tokens of essay_text(min_chars=8 * 4,609): far fewer characters
    from bench.commands.eval_ppl import TURN_TOKENS, TURNS

    n = TURNS * TURN_TOKENS + 1
    assert len(held) > 50_000 and joined.endswith(held)
    assert joined.find(held) > len(data.essay_text(min_chars=8 * n))


def test_sharegpt_has_multiturn_human_messages():
    records = data.sharegpt()
    assert len(records) > 10_000
    assert all({"id", "conversations"} <= rec.keys() for rec in records[:100])
    convs = data.sharegpt_conversations(20, min_turns=2, max_turns=4, max_chars=600)
    assert len(convs) == 20
    for turns in convs:
        assert 2 <= len(turns) <= 4
        assert all(0 < len(t) <= 600 and t.strip() for t in turns)
    assert len({turns[0] for turns in convs}) > 15  # distinct conversations, not one repeated
