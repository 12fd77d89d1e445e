"""KIVI (kivi1, kivi2, kivi3, kivi4): the packed base alone, which every other format builds on (formats/base.py
holds its behaviour as the defaults). Keys per channel over a page, values per token and channel group, the open
page and the recent window R in fp16 frames. kivimix: the same pages with each layer's key and value width from a
recipe (sgl_kvq/recipe.py)."""

from __future__ import annotations

from dataclasses import dataclass

from sgl_kvq.errors import KVQConfigError
from sgl_kvq.formats.base import Format
from sgl_kvq.recipe import Recipe, load_recipe, shipped


# Widths whose extends attend page by page (KVQ_PREFILL=paged) by default. The rule: paged where it passes a kit
# test full fails, or lowers both KL tests without raising cached-turn perplexity; kivi4 and kivi3 meet it on
# SmolLM2 and no other format does (docs/knobs.md, KVQ_PREFILL; docs/conformance.md, "Which prefill each dtype
# defaults to"; bench/results/quality/ppl-prefill-smollm2.json,
# bench/results/conformance-kl-prefill-paged-smollm2.json).
PAGED_PREFILL_BITS = (3, 4)


class Kivi(Format):
    family = "kivi"
    bits = (1, 2, 3, 4)

    def default_knobs(self, bits: int, params=None) -> dict:
        paged = {"prefill": "paged"} if bits in PAGED_PREFILL_BITS else {}
        return {**super().default_knobs(bits, params), **paged}


FORMAT = Kivi()


@dataclass(frozen=True)
class RecipeParams:
    # The widths each layer's keys and values get (sgl_kvq/recipe.py), from KVQ_RECIPE: a recipe file or the name
    # of a shipped one. None: not set, which kivimix refuses.
    recipe: Recipe | None = None


class KiviMix(Kivi):
    """KIVI's pages with a code width per layer and per K/V, read from a recipe (`sgl-kvq calibrate` makes one).
    Its one dtype name is `kivimix`; `bits` is the widest width the pool may hold (the recipe's are per layer)."""
    family = "kivimix"
    bits = (4,)
    params = RecipeParams
    knobs = {"KVQ_RECIPE": ("recipe", load_recipe)}

    def dtype_name(self, bits: int) -> str:
        return self.family

    def default_knobs(self, bits: int, params=None) -> dict:
        # Values are rotated at every width: the recipes put most values at 1-2 bits, where kivi rotates them
        # (formats/rotation.py); at 3 and 4 bits the rotation changes their error little either way. The prefill is
        # the recipe's where it names one (the rule of docs/knobs.md, KVQ_PREFILL, differs by recipe:
        # docs/recipes.md, "Which prefill a recipe takes"), else full.
        recipe = params.recipe if params is not None else None
        return {"rotate": "values", **({"prefill": recipe.prefill} if recipe and recipe.prefill else {})}

    def check(self, cfg) -> None:
        if cfg.params.recipe is None:
            names = ", ".join(shipped()) or "none"
            raise KVQConfigError(f"sgl_kvq: kivimix serves a recipe's per-layer widths: set KVQ_RECIPE to a recipe "
                                 f"file (`sgl-kvq calibrate --model MODEL --recipe-dir DIR` writes them) or to a "
                                 f"shipped one ({names})")

    def layer_bits(self, cfg, layer: int) -> tuple[int, int]:
        return cfg.params.recipe.widths(layer)

    def widths(self, cfg) -> set[int]:
        r = cfg.params.recipe
        return set(r.key_bits) | set(r.value_bits)

    def stats(self, cfg, sizes: dict[str, int]) -> dict:
        r = cfg.params.recipe
        return {"bits": r.mean_bits, "recipe": r.digest, "key_bits": list(r.key_bits), "value_bits": list(r.value_bits)}

    def check_model(self, cfg, layers: int, kv_heads: int, head_dim: int, config_sha256: str | None,
                    arch: str) -> None:
        cfg.params.recipe.check_model(layers, kv_heads, head_dim, config_sha256, arch)


MIXED = KiviMix()
