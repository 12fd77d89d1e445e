"""GEAR (gear2) and GEAR-L (gearl2): KIVI's 2-bit page of the page with its outliers removed, plus per KV head a
rank-r approximation of the quantization residual and (gear2) each row's largest deviations as fp16 outliers
(sgl_kvq/formats/gear/codec.py, the one implementation; sgl_kvq/formats/gear/kernel.py adds it in registers)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kvq.errors import KVQConfigError, LayoutError
from sgl_kvq.formats.base import Format, PageWrite
from sgl_kvq.layout import PageGeometry, Shapes
from sgl_kvq.formats.gear.codec import PageCorrection, add_low_rank, correct_keys, correct_values, outliers_per_row, \
    pack_gear_pages, select_pages
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


class Gear(Format):
    bits = (2,)
    extras = PageCorrection
    kernel = "gear"
    # the compression (power iteration, outliers) runs in torch on both backends
    quantize_kernel = False
    plain_pages = False
    params = GearParams
    knobs = {"KVQ_GEAR_RANK": ("rank", int), "KVQ_GEAR_ITERS": ("iters", int), "KVQ_GEAR_OUTLIERS": ("outliers", float)}

    def __init__(self, family: str, outliers: bool):
        self.family, self.outliers = family, outliers

    def kernel_corrections(self) -> tuple:
        from sgl_kvq.formats.gear.kernel import _gear_kt, _gear_v

        return _gear_kt, _gear_v

    def check_params(self, params: GearParams, group_size: int) -> None:
        if not 1 <= params.rank <= group_size:
            raise KVQConfigError(f"sgl_kvq: KVQ_GEAR_RANK={params.rank} must be in 1..G={group_size}, e.g. 2")
        if params.iters < 1:
            raise KVQConfigError(f"sgl_kvq: KVQ_GEAR_ITERS={params.iters} must be at least 1, e.g. 3")
        if not 0 < params.outliers < 0.5:
            raise KVQConfigError(f"sgl_kvq: KVQ_GEAR_OUTLIERS={params.outliers} must be in (0, 0.5), e.g. 0.02 "
                                 "(for no outliers use gearl2)")

    def outliers_per_row(self, cfg, row_length: int) -> int:
        """fp16 outliers kept per row of `row_length` entries (0 for GEAR-L)."""
        return outliers_per_row(cfg.params.outliers, row_length) if self.outliers else 0

    def sizes(self, cfg, g: PageGeometry) -> dict[str, int]:
        return dict(rank=cfg.params.rank, nk=self.outliers_per_row(cfg, g.G), nv=self.outliers_per_row(cfg, g.D))

    def sizes_of(self, c: PageCorrection, g: PageGeometry) -> dict[str, int]:
        rank = c.k_u.shape[2]
        if rank < 1:
            raise LayoutError("sgl_kvq kernels: a GEAR correction needs rank >= 1")
        return dict(rank=rank, nk=c.k_out_val.shape[2], nv=c.v_out_val.shape[-1])

    def page_shapes(self, g: PageGeometry, **sizes) -> Shapes:
        return gear_shapes(g, **sizes)

    def stats(self, cfg, sizes: dict[str, int]) -> dict:
        return {"gear_rank": sizes["rank"], "outliers_per_key_channel": sizes["nk"],
                "outliers_per_value_token": sizes["nv"]}

    def pack(self, cfg, value_group: int, k, v, w: PageWrite, tables: dict):
        G, D = k.shape[1], k.shape[3]
        return pack_gear_pages(k, v, cfg.bits, value_group, cfg.params.rank, cfg.params.iters,
                               self.outliers_per_row(cfg, G), self.outliers_per_row(cfg, D),
                               specache_one_bit=cfg.specache_one_bit)

    def correct(self, k, v, extras, pages):
        pc = select_pages(extras, pages)
        return correct_keys(k, pc), correct_values(v, pc)

    def correct_padded(self, k, v, c: PageCorrection, ctx) -> None:
        """In correct_keys' order: low rank, then outliers replace their entries. Zeroed outside base
        pages/tokens (the overlay copy overwrites those positions; padding must stay finite)."""
        off_page = ~ctx.is_base_page[..., None, None, None]  # [B, U, 1, 1, 1]
        for x, u, w in ((k, c.k_u, c.k_w), (v, c.v_u, c.v_w)):
            add_low_rank(x, u[ctx.pages].float().masked_fill_(off_page, 0).permute(2, 0, 1, 3, 4),  # [H, B, U, r, G]
                         w[ctx.pages].float().masked_fill_(off_page, 0).permute(2, 0, 1, 3, 4))  # [H, B, U, r, D]
        if c.k_out_val.shape[2]:
            idx = c.k_out_idx[ctx.pages].long().masked_fill_(off_page, 0).permute(2, 0, 1, 3, 4)  # [H, B, U, NK, D]
            k.scatter_(3, idx, c.k_out_val[ctx.pages].float().masked_fill_(off_page, 0).permute(2, 0, 1, 3, 4))
        if c.v_out_val.shape[-1]:
            off_tok = ~ctx.is_base_tok[:, None, None]
            idx = c.v_out_idx[ctx.slots].long().masked_fill_(off_tok, 0).transpose(0, 1)  # [H, B * T, NV]
            val = c.v_out_val[ctx.slots].float().masked_fill_(off_tok, 0).transpose(0, 1)
            H, D = v.shape[0], v.shape[-1]
            v.view(H, -1, D).scatter_(2, idx, val)


GEAR = Gear("gear", outliers=True)
GEARL = Gear("gearl", outliers=False)
