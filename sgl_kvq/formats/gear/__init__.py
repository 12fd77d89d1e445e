"""GEAR (gear2) and GEAR-L (gearl2): KIVI's 2-bit page of the page with its outliers removed, plus per KV head a
rank-r approximation of the quantization residual and (gear2) each row's largest deviations as fp16 outliers
(sgl_kvq/formats/gear/codec.py, the one implementation; sgl_kvq/formats/gear/kernel.py adds it in registers)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kvq.errors import KVQConfigError, LayoutError
from sgl_kvq.formats.base import Format
from sgl_kvq.formats.gear.codec import GearCodec, PageCorrection
from sgl_kvq.formats.kernel_variant import KernelVariant
from sgl_kvq.layout import PageGeometry, Shapes
from sgl_kvq.quant.uniform import SCALE_DTYPE


def gear_shapes(g: PageGeometry, rank: int, nk: int, nv: int) -> Shapes:
    """One layer's correction: PageCorrection's fields in its order (nk / nv outliers per key channel / value
    token; the value outliers are per token slot)."""
    P, S, H, D, G = g.P, g.S, g.H, g.D, g.G
    return {
        "k_u": ((P, H, rank, G), SCALE_DTYPE), "k_w": ((P, H, rank, D), SCALE_DTYPE),
        "v_u": ((P, H, rank, G), SCALE_DTYPE), "v_w": ((P, H, rank, D), SCALE_DTYPE),
        "k_out_val": ((P, H, nk, D), SCALE_DTYPE), "k_out_idx": ((P, H, nk, D), torch.uint8),
        "v_out_val": ((S, H, nv), SCALE_DTYPE), "v_out_idx": ((S, H, nv), torch.uint8),
    }


@dataclass(frozen=True)
class GearParams:
    """GEAR / GEAR-L's knobs. Each page of G = 64 tokens is compressed once, when it completes: GEAR's streaming
    buffer (n_b = 64) at its decode-phase rank 2."""
    rank: int = 2  # of the quantization residual's approximation per page and KV head
    iters: int = 3  # power-iteration steps
    # Share of each row kept as fp16 outliers (GEAR's s = 2%; gear2 only): keys per channel over the page's G
    # tokens, values per token over its D channels, at least one per row.
    outliers: float = 0.02


class GearKernel(KernelVariant):
    def sizes_of(self, c: PageCorrection, g: PageGeometry) -> dict[str, int]:
        rank = c.k_u.shape[2]
        if rank < 1:
            raise LayoutError("sgl_kvq kernels: a GEAR correction needs rank >= 1")
        return dict(rank=rank, nk=c.k_out_val.shape[2], nv=c.v_out_val.shape[-1])


# the compression (power iteration, outliers) runs in torch on both backends
KERNEL = GearKernel("gear", "sgl_kvq.formats.gear.kernel", quantize=False)


class Gear(Format):
    bits = (2,)
    extras = PageCorrection
    kernel = KERNEL
    params = GearParams
    knobs = {"KVQ_GEAR_RANK": ("rank", int), "KVQ_GEAR_ITERS": ("iters", int), "KVQ_GEAR_OUTLIERS": ("outliers", float)}

    def __init__(self, family: str, outliers: bool):
        self.family, self.codec = family, GearCodec(outliers)

    def check_params(self, params: GearParams, group_size: int) -> None:
        if not 1 <= params.rank <= group_size:
            raise KVQConfigError(f"sgl_kvq: KVQ_GEAR_RANK={params.rank} must be in 1..G={group_size}, e.g. 2")
        if params.iters < 1:
            raise KVQConfigError(f"sgl_kvq: KVQ_GEAR_ITERS={params.iters} must be at least 1, e.g. 3")
        if not 0 < params.outliers < 0.5:
            raise KVQConfigError(f"sgl_kvq: KVQ_GEAR_OUTLIERS={params.outliers} must be in (0, 0.5), e.g. 0.02 "
                                 "(for no outliers use gearl2)")

    def sizes(self, cfg, g: PageGeometry) -> dict[str, int]:
        return dict(rank=cfg.params.rank, nk=self.codec.outliers_per_row(cfg, g.G),
                    nv=self.codec.outliers_per_row(cfg, g.D))

    def page_shapes(self, g: PageGeometry, **sizes) -> Shapes:
        return gear_shapes(g, **sizes)

    def stats(self, cfg, sizes: dict[str, int]) -> dict:
        return {"gear_rank": sizes["rank"], "outliers_per_key_channel": sizes["nk"],
                "outliers_per_value_token": sizes["nv"]}


GEAR = Gear("gear", outliers=True)
GEARL = Gear("gearl", outliers=False)
