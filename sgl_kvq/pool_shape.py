"""A pool's shape: layers, KV heads, head dim and pages under one KVQConfig, and what follows from them through the
served format's declaration (its tensors, bytes per token, frame sizes). The tensors themselves are written down in
sgl_kvq/layout.py; this module sits above the config because it asks the config's format."""

from __future__ import annotations

import functools
import math
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
        """Bytes of the narrowest token-head code row over every layer's k_codes and v_codes, as the format
        declares them (pooled frames are their bytes)."""
        return min(self.layer_shapes(layer)[name][0][-1] for layer in range(self.layers)
                   for name in ("k_codes", "v_codes"))

    def layer_bits(self, layer: int) -> tuple[int, int]:
        return self.cfg.layer_bits(layer)

    @functools.cached_property
    def uniform(self) -> bool:
        """Whether every layer stores the same tensors (no recipe, or one width throughout): the pool's tensors are
        then [L, ...]; else the code tensors are one per layer (sgl_kvq/layer_tensors.py)."""
        return len({self.layer_bits(layer) for layer in range(self.layers)}) == 1

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

    def layer_shapes(self, layer: int) -> Shapes:
        """Layer `layer`'s base and extra tensors, the layer dim removed."""
        k_bits, v_bits = self.layer_bits(layer)
        return {**self.cfg.format.base_shapes(self.geometry, k_bits, v_bits), **self.extra_shapes()}

    def base_names(self) -> tuple[str, ...]:
        return tuple(self.layer_shapes(0))

    def base_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every base tensor as the pool allocates it, [L, ...], where every layer's shapes agree (uniform)."""
        if not self.uniform:
            raise AssertionError("sgl_kvq: a recipe's layers differ in shape; read layer_shapes(layer)")
        return {name: ((self.layers, *shape), dtype) for name, (shape, dtype) in self.layer_shapes(0).items()}

    def frame_state_shapes(self) -> Shapes:
        """The per-request state the served format keeps with each overlay frame, allocated [L, F, ...]."""
        return self.cfg.format.frame_shapes(self.geometry)

    def layer_base_bytes_per_token(self) -> list[float]:
        """Bytes the base stores per token in each layer (codes + scales/zeros; a recipe's layers differ)."""
        return [sum(math.prod(shape[1:]) * dtype.itemsize / (self.G if shape[0] == self.P else 1)
                    for shape, dtype in self.layer_shapes(layer).values()) for layer in range(self.layers)]

    def base_bytes_per_token(self) -> float:
        """Bytes the base stores per token over all layers (codes + scales/zeros), page 0 not counted."""
        return sum(self.layer_base_bytes_per_token())

    def pages_per_frame(self, model_dtype: torch.dtype) -> int:
        """k: pool pages whose packed codes hold one model-dtype frame (a frame's K over k pages' k_codes, its V
        over their v_codes) in every layer: the narrowest code row decides. Rounded up where a frame is no whole
        number of pages (3 bits: a 128-byte bf16 row of 64 channels over 24-byte code rows, 5.33 pages: k = 6, the
        last page's remaining bytes unused; under a recipe a wider layer's frame leaves more of its pages unused)."""
        frame_row = self.head_dim * torch.empty((), dtype=model_dtype).element_size()
        return -(-frame_row // self.Dp)

    def frame_page_bytes(self, model_dtype: torch.dtype) -> int:
        """Budget bytes one pooled frame takes: its k pages, codes, scales and extras alike."""
        return round(self.pages_per_frame(model_dtype) * self.G * self.base_bytes_per_token())

    def overlay_bytes_per_frame(self, model_dtype: torch.dtype) -> int:
        L, H, D = self.layers, self.heads, self.head_dim
        state = sum(L * math.prod(shape) * dtype.itemsize for shape, dtype in self.frame_state_shapes().values())
        return 2 * L * self.G * H * D * torch.empty((), dtype=model_dtype).element_size() + 16 + state
