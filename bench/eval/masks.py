"""Which keys each query sees in the offline attention evaluations (bench/eval/attention.py, bench/eval/specache.py),
with HF's sliding-window convention: a sliding layer's query i sees keys i - window + 1 .. i, which is SGLang's
sliding_window_size = window - 1 (the convention of attention_ref.visible_from, which every served path uses)."""

from __future__ import annotations

import torch

from sgl_kvq.attention_ref import visible_from


def visible(rows: torch.Tensor, T: int, window: int | None = None) -> torch.Tensor:
    """[R, T] bool: the keys each query row sees, 0..row, or with a sliding window row - window + 1..row."""
    t, r = torch.arange(T)[None, :], rows[:, None]
    return (t <= r) & (t >= visible_from(r, -1 if window is None else window - 1))
