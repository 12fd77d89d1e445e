"""One pool tensor whose layers differ in shape (a recipe's per-layer code widths: k_codes [S, H, Dp_l]), indexed
as the [L, ...] tensors of a uniform pool are: `t[layer]` is the layer's tensor, `t[layer, idx]` reads and
`t[layer, idx] = x` writes into it. The layers are views into one buffer, so the pool allocates one block per name
as it does for a uniform width."""

from __future__ import annotations

import math

import torch


class LayerTensors:
    def __init__(self, layers: list[torch.Tensor]):
        self.layers = layers

    @classmethod
    def zeros(cls, shapes: list[tuple[int, ...]], dtype: torch.dtype, device) -> LayerTensors:
        sizes = [math.prod(s) for s in shapes]
        block = torch.zeros(sum(sizes), dtype=dtype, device=device)
        out, at = [], 0
        for shape, n in zip(shapes, sizes):
            out.append(block[at:at + n].view(shape))
            at += n
        return cls(out)

    def __len__(self) -> int:
        return len(self.layers)

    def _split(self, key):
        if isinstance(key, tuple):
            return self.layers[key[0]], key[1:]
        return self.layers[key], ()

    def __getitem__(self, key):
        t, rest = self._split(key)
        return t[rest] if rest else t

    def __setitem__(self, key, value):
        t, rest = self._split(key)
        t[rest if rest else ...] = value

    def numel(self) -> int:
        return sum(t.numel() for t in self.layers)

    def element_size(self) -> int:
        return self.layers[0].element_size()

    @property
    def dtype(self) -> torch.dtype:
        return self.layers[0].dtype

    @property
    def device(self) -> torch.device:
        return self.layers[0].device
