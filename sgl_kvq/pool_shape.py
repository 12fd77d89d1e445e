"""A pool's shape: layers, KV heads, head dim and pages under one KVQConfig, and what follows from them through the
served format's declaration (its tensors, bytes per token, frame sizes). The tensors themselves are written down in
sgl_kvq/layout.py; this module sits above the config because it asks the config's format."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sgl_kvq.layout import PageGeometry, Shapes

if TYPE_CHECKING:
    from sgl_kvq.config import KVQConfig


@dataclass(frozen=True)
class PoolShape:
    layers: int
    heads: int  # KV heads
    head_dim: int
    num_pages: int  # usable pages, page 0 excluded
    cfg: KVQConfig

    @property
    def G(self) -> int:
        return self.cfg.group_size

    @property
    def P(self) -> int:
        return self.num_pages + 1

    @property
    def S(self) -> int:
        return self.P * self.G

    @property
    def Dp(self) -> int:
        """Bytes of one token-head's key codes, as the format declares k_codes (pooled frames are their bytes)."""
        return self.cfg.format.base_shapes(self.geometry, self.cfg.bits)["k_codes"][0][-1]

    @property
    def VG(self) -> int:
        return self.cfg.value_group_for(self.head_dim)

    @property
    def geometry(self) -> PageGeometry:
        return PageGeometry(P=self.P, G=self.G, H=self.heads, D=self.head_dim, NG=self.head_dim // self.VG)

    def format_sizes(self) -> tuple[str, dict[str, int]]:
        """The kernels' name of the format whose tensors each page carries beside KIVI's ("" for none) and its
        sizes from the config (sgl_kvq/formats/)."""
        fmt = self.cfg.format
        return fmt.kernel.name if fmt.kernel else "", fmt.sizes(self.cfg, self.geometry)

    def extra_shapes(self) -> Shapes:
        """The tensors the served format adds to each page, one layer's."""
        fmt = self.cfg.format
        return fmt.page_shapes(self.geometry, **fmt.sizes(self.cfg, self.geometry))

    def base_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        shapes = {**self.cfg.format.base_shapes(self.geometry, self.cfg.bits), **self.extra_shapes()}
        return {name: ((self.layers, *shape), dtype) for name, (shape, dtype) in shapes.items()}

    def frame_state_shapes(self) -> Shapes:
        """The per-request state the served format keeps with each overlay frame, allocated [L, F, ...]."""
        return self.cfg.format.frame_shapes(self.geometry)

    def base_bytes_per_token(self) -> float:
        """Bytes the base stores per token over all layers (codes + scales/zeros), page 0 not counted."""
        total = 0
        for shape, dtype in self.base_shapes().values():
            per = 1
            for s in shape[2:]:
                per *= s
            per *= shape[0] * torch.empty((), dtype=dtype).element_size()
            total += per / (self.G if shape[1] == self.P else 1)
        return total

    def pages_per_frame(self, model_dtype: torch.dtype) -> int:
        """k: pool pages whose packed codes hold one model-dtype frame (a frame's K over k pages' k_codes, its V
        over their v_codes). Rounded up where a frame is no whole number of pages (3 bits: a 128-byte bf16 row of
        64 channels over 24-byte code rows, 5.33 pages: k = 6, the last page's remaining bytes unused)."""
        frame_row = self.head_dim * torch.empty((), dtype=model_dtype).element_size()
        return -(-frame_row // self.Dp)

    def frame_page_bytes(self, model_dtype: torch.dtype) -> int:
        """Budget bytes one pooled frame takes: its k pages, codes, scales and extras alike."""
        return round(self.pages_per_frame(model_dtype) * self.G * self.base_bytes_per_token())

    def overlay_bytes_per_frame(self, model_dtype: torch.dtype) -> int:
        L, H, D = self.layers, self.heads, self.head_dim
        state = sum(L * _numel(shape) * dtype.itemsize for shape, dtype in self.frame_state_shapes().values())
        return 2 * L * self.G * H * D * torch.empty((), dtype=model_dtype).element_size() + 16 + state


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
