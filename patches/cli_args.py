"""`--kv-cache-dtype kivi2` and `--attention-backend kvq_torch` on SGLang's argparse (Engine(...) skips argparse)."""

from __future__ import annotations

from sgl_kvq.config import ALL_DTYPE_NAMES, DTYPE_NAMES

BACKENDS = ("kvq_torch", "kvq_triton")


def extend_kv_cache_dtype_choices(result, parser, *args, **kwargs):
    for action in parser._actions:
        if action.dest == "kv_cache_dtype" and action.choices is not None:
            action.choices = list(action.choices) + [n for n in ALL_DTYPE_NAMES if n not in action.choices]
            action.help = (action.help or "") + (
                f' sgl_kvq adds {", ".join(DTYPE_NAMES)}: 1/2/3/4-bit KV behind the radix cache, and kivimix: a '
                "width per layer from a recipe (KVQ_RECIPE; knobs: KVQ_* environment variables; see the sgl_kvq "
                "README).")
    return result


def register_backend_choices() -> None:
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    add_attention_backend_choices([b for b in BACKENDS if b not in ATTENTION_BACKEND_CHOICES])
