"""When each served dtype's defaults last changed what an engine run of it computes. An engine result measured before
then ran the dtype otherwise, so the decision table does not read it for that dtype (bench/decision/cells.py). The
product declares the defaults (sgl_kvq/formats/: Format.default_knobs); this table only dates their changes."""

from __future__ import annotations

from datetime import datetime

# (when, the default knob and value it introduced, the family it applies to or None for all): a dtype of that family
# whose defaults hold that value changed then
CHANGES = [
    # kivi3 and kivi4 attend page by page (sgl_kvq/formats/kivi.py PAGED_PREFILL_BITS)
    ("2026-11-29T14:39:00+00:00", "prefill", "paged", None),
    # the widths sgl_kvq/formats/rotation.py VALUES_ROTATED names store their values rotated
    ("2026-12-02T06:15:00+00:00", "rotate", "values", None),
    # a recipe names its prefill (sgl_kvq/recipe.py Recipe.prefill; docs/recipes.md, "Which prefill a recipe takes")
    ("2026-12-07T00:33:00+00:00", "prefill", "paged", "kivimix"),
]
# A shipped recipe's row, as the evaluations name it: kivimix served with that recipe.
RECIPE_ROW = "kivimix:KVQ_RECIPE="


def defaults_changed(dtype: str) -> float | None:
    """When `dtype`'s defaults last changed what its engine runs compute (seconds since the epoch), else None (bf16,
    or a dtype whose defaults never changed)."""
    from sgl_kvq.formats import registry

    if not dtype.startswith(RECIPE_ROW) and dtype not in registry.BY_NAME:
        return None
    cfg = row_config(dtype)
    changed = [when for when, knob, value, family in CHANGES
               if family in (None, cfg.method) and getattr(cfg, knob) == value]
    return datetime.fromisoformat(max(changed)).timestamp() if changed else None


def row_config(dtype: str):
    """The config a table row's dtype (a dtype name, or RECIPE_ROW + a shipped recipe) is served with when no KVQ_*
    variable is set."""
    from sgl_kvq.config import default_config

    recipe = dtype[len(RECIPE_ROW):] if dtype.startswith(RECIPE_ROW) else None
    return default_config("kivimix" if recipe else dtype, recipe)
