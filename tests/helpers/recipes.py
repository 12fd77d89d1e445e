"""Recipes for the tiny fp32 Llama (2 layers, 2 KV heads, head_dim 16), bound to its config.json as a calibrated
one is, for the engine tests that serve kivimix."""

from __future__ import annotations

from pathlib import Path

from sgl_kvq.recipe import ModelBinding, Recipe, config_sha256

# keys and values at other widths in each layer, and each layer's pair differs: every mixed path is exercised
MIXED = ((4, 1), (1, 3))


def tiny_recipe(folder: Path, key_bits=tuple(k for k, _ in MIXED), value_bits=tuple(v for _, v in MIXED),
                prefill: str | None = None, **model) -> str:
    """Write a recipe for the tiny Llama into `folder` -> its path (prefill: the one it names; model: binding fields
    to override)."""
    from bench.models import tiny_llama

    binding = {"layers": 2, "kv_heads": 2, "head_dim": 16, "config_sha256": config_sha256(tiny_llama()), **model}
    path = Path(folder) / "recipe.json"
    path.write_text(Recipe(ModelBinding(**binding), tuple(key_bits), tuple(value_bits), prefill).to_json())
    return str(path)


def serve_recipe_if_asked(mp, dtype: str, folder: Path) -> None:
    """A recipe dtype (kivimix) serves the tiny Llama's mixed recipe: KVQ_RECIPE set through `mp` (a MonkeyPatch)."""
    from sgl_kvq.config import RECIPE_DTYPE_NAMES

    if dtype in RECIPE_DTYPE_NAMES:
        mp.setenv("KVQ_RECIPE", tiny_recipe(folder))
