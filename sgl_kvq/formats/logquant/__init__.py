"""LogQuant (logquant2): KIVI's 2-bit page plus M fp16 row slots holding the positions LogQuant's rule keeps when
the page leaves the fp16 window, read instead of their codes (sgl_kvq/formats/logquant/codec.py, the one
implementation; sgl_kvq/formats/logquant/kernel.py replaces them in registers). Which rows a page keeps depends on
its logical page index alone, so its write needs each completing page's index (PageWrite.lpages)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kvq.errors import KVQConfigError, LayoutError
from sgl_kvq.formats.base import Format
from sgl_kvq.formats.kernel_variant import KernelVariant
from sgl_kvq.formats.logquant.codec import LogQuantCodec, PageRows, rows_of, rows_per_page
from sgl_kvq.layout import PageGeometry, Shapes
from sgl_kvq.quant.uniform import SCALE_DTYPE


def logquant_shapes(g: PageGeometry, rows: int) -> Shapes:
    """One layer's row slots: PageRows' fields in its order."""
    return {
        "k_rows": ((g.P, rows, g.H, g.D), SCALE_DTYPE), "v_rows": ((g.P, rows, g.H, g.D), SCALE_DTYPE),
        "row_off": ((g.P, rows), torch.uint8),
    }


@dataclass(frozen=True)
class LogQuantParams:
    # LogQuant's window W. The rule keeps the sink and a band of about 6W recent positions; W = 10 (band ~ R) keeps
    # logquant2 a 2-bit cache, where the reference's W = 21 costs kivi4's bytes (docs/knobs.md, KVQ_LOGQUANT_WINDOW).
    window: int = 10


class LogQuantKernel(KernelVariant):
    def sizes_of(self, r: PageRows, g: PageGeometry) -> dict[str, int]:
        rows = r.row_off.shape[-1]
        if not (rows >= 1 and g.G <= 128):
            raise LayoutError(f"sgl_kvq kernels: LogQuant rows need M >= 1 slots and G <= 128 (255 marks empty), "
                              f"got {rows}, {g.G}")
        return dict(rows=rows)

    def written_extras(self, pages, lpages, pages_kv, tables: dict):
        # every row's frame gives its rows (static shapes, no sync); rows that complete no page write dummy page 0
        return rows_of(lpages, *pages_kv(), tables)


class LogQuant(Format):
    family = "logquant"
    bits = (2,)
    extras = PageRows
    codec = LogQuantCodec()
    kernel = LogQuantKernel("logquant", "sgl_kvq.formats.logquant.kernel")
    params = LogQuantParams
    knobs = {"KVQ_LOGQUANT_WINDOW": ("window", int)}

    def check_params(self, params: LogQuantParams, group_size: int) -> None:
        if params.window < 1:
            raise KVQConfigError(f"sgl_kvq: KVQ_LOGQUANT_WINDOW={params.window} must be at least 1, e.g. 10")

    def check(self, cfg) -> None:
        if cfg.group_size > 128:
            raise KVQConfigError(f"sgl_kvq: logquant2 stores row offsets as uint8 with 255 for an empty slot: "
                                 f"G={cfg.group_size} must be at most 128, e.g. 64")

    def sizes(self, cfg, g: PageGeometry) -> dict[str, int]:
        return dict(rows=rows_per_page(cfg))

    def page_shapes(self, g: PageGeometry, **sizes) -> Shapes:
        return logquant_shapes(g, **sizes)

    def stats(self, cfg, sizes: dict[str, int]) -> dict:
        return {"logquant_window": cfg.params.window, "logquant_rows_per_page": sizes["rows"]}


FORMAT = LogQuant()
