"""How the Triton attention kernels read a format's pages: the in-register correction they apply to each
dequantized base page, the sizes they take from a layer view's extras, and whether the Triton quantize kernel
writes the pages' codes. A format whose kernel is None has no Triton kernel: kvq_triton refuses it before the model
loads.

The corrections are jitted functions in the format package's kernel.py (sgl_kvq/kernels/paged_kv_kernel.py takes
them as a constexpr pair), imported only when asked for, so that a kvq_torch process never imports Triton.
"""

from __future__ import annotations

import importlib
from typing import Callable

import torch


class KernelVariant:
    def __init__(self, name: str, module: str, *, quantize: bool = True):
        """name: the kernels' name of the format ("" for KIVI's pages alone); module: the kernel.py defining
        CORRECT = (K^T's correction, V's); quantize: whether the Triton quantize kernel writes the pages' codes
        (bit-exact with PageCodec.pack; False: torch compresses them on both backends)."""
        self.name, self.module, self.quantize = name, module, quantize

    def corrections(self) -> tuple:
        """The jitted functions the attention kernels apply to a dequantized base page, K^T [D, G] then V [G, D]."""
        return importlib.import_module(self.module).CORRECT

    def sizes_of(self, extras: tuple, g) -> dict[str, int]:
        """Format.sizes read off a layer view's extras (the kernels' launch arguments, checked against
        Format.page_shapes; g: the layer's PageGeometry): raises LayoutError where they are out of the bounds the
        correction reads."""
        return {}

    def written_extras(self, pages: torch.Tensor, lpages: torch.Tensor | None,
                       pages_kv: Callable[[], tuple[torch.Tensor, torch.Tensor]], tables: dict) -> tuple | None:
        """Where the quantize kernel wrote the codes of pool pages `pages`: their extras (pages_kv() gives their
        K/V [N, G, H, D]; tables: PageCodec.tables), or None."""
        return None


KIVI_KERNEL = KernelVariant("", "sgl_kvq.formats.plain_kernel")
