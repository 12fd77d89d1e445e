"""When each served dtype's defaults last changed what an engine run of it computes. An engine result measured before
then ran the dtype otherwise, so the decision table does not read it for that dtype (bench/decision/cells.py). The
product declares the defaults (sgl_kvq/formats/: Format.default_knobs); this table only dates their changes."""

from __future__ import annotations

from datetime import datetime

# (when, the default knob and value it introduced): a dtype whose defaults hold that value changed then
CHANGES = [
    # kivi3 and kivi4 attend page by page (sgl_kvq/formats/kivi.py PAGED_PREFILL_BITS)
    ("2026-11-29T14:39:00+00:00", "prefill", "paged"),
    # the widths sgl_kvq/formats/rotation.py VALUES_ROTATED names store their values rotated
    ("2026-12-02T06:15:00+00:00", "rotate", "values"),
]


def defaults_changed(dtype: str) -> float | None:
    """When `dtype`'s defaults last changed what its engine runs compute (seconds since the epoch), else None (bf16,
    or a dtype whose defaults never changed)."""
    from sgl_kvq.formats import registry

    if dtype not in registry.BY_NAME:
        return None
    fmt, bits = registry.BY_NAME[dtype]
    defaults = fmt.default_knobs(bits)
    changed = [when for when, knob, value in CHANGES if defaults.get(knob) == value]
    return datetime.fromisoformat(max(changed)).timestamp() if changed else None
