"""ZipCache (zipcache2): KIVI's 2-bit page of (K with its salient rows replaced by channel medians, V / c) plus per
KV head its most salient tokens at 4 bit (sgl_kvq/formats/zipcache/codec.py, the one implementation;
sgl_kvq/formats/zipcache/kernel.py replaces them in registers, then V times c).

Saliency is the attention a page's own queries paid its tokens, so the write needs the batch's queries. Queries of
earlier batches are gone when a page completes, so what they paid is accumulated per overlay frame (ov_score, the
format's per-request state) as they are written; the completing batch adds its own queries' share to the frame's
total."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kvq.errors import KVQConfigError, LayoutError
from sgl_kvq.formats.base import Format
from sgl_kvq.formats.kernel_variant import KernelVariant
from sgl_kvq.formats.zipcache.codec import SALIENT_BITS, SalientPlane, ZipCacheCodec, salient_count, \
    salient_per_page
from sgl_kvq.layout import PageGeometry, Shapes
from sgl_kvq.quant.pack import packed_dim
from sgl_kvq.quant.uniform import SCALE_DTYPE


def zipcache_shapes(g: PageGeometry, salient: int, salient_bits: int) -> Shapes:
    """One layer's salient plane: SalientPlane's fields in its order."""
    P, H, D, Ds = g.P, g.H, g.D, packed_dim(g.D, salient_bits)
    return {
        "v_chan": ((P, H, D), SCALE_DTYPE), "s_idx": ((P, H, salient), torch.uint8),
        "s_k_codes": ((P, H, salient, Ds), torch.uint8),
        "s_k_scale": ((P, H, D), SCALE_DTYPE), "s_k_zero": ((P, H, D), SCALE_DTYPE),
        "s_v_codes": ((P, H, salient, Ds), torch.uint8),
        "s_v_scale": ((P, H, salient, g.NG), SCALE_DTYPE), "s_v_zero": ((P, H, salient, g.NG), SCALE_DTYPE),
    }


@dataclass(frozen=True)
class ZipCacheParams:
    # Share of each page's G tokens (per KV head) kept at 4 bit, NS = round(ratio * G). 0.4 puts zipcache2 at about
    # kivi4's bytes, so the two compare at equal memory (docs/knobs.md, KVQ_ZIPCACHE_SALIENT).
    salient: float = 0.4


class ZipCacheKernel(KernelVariant):
    def sizes_of(self, s: SalientPlane, g: PageGeometry) -> dict[str, int]:
        salient = s.s_idx.shape[-1]
        if not 1 <= salient < g.G:
            raise LayoutError(f"sgl_kvq kernels: zipcache2 needs 1..G-1 salient tokens per page, got {salient}")
        return dict(salient=salient, salient_bits=SALIENT_BITS)


class ZipCache(Format):
    family = "zipcache"
    bits = (2,)
    extras = SalientPlane
    codec = ZipCacheCodec()
    # saliency and the median fill run in torch on both backends
    kernel = ZipCacheKernel("zipcache", "sgl_kvq.formats.zipcache.kernel", quantize=False)
    params = ZipCacheParams
    knobs = {"KVQ_ZIPCACHE_SALIENT": ("salient", float)}

    def check_params(self, params: ZipCacheParams, group_size: int) -> None:
        g = group_size
        if not 0 < params.salient < 1 or not 1 <= salient_count(params.salient, g) < g:
            raise KVQConfigError(f"sgl_kvq: KVQ_ZIPCACHE_SALIENT={params.salient} must be in (0, 1) and keep "
                                 f"between 1 and G-1={g - 1} of a page's {g} tokens salient, e.g. 0.4")

    def sizes(self, cfg, g: PageGeometry) -> dict[str, int]:
        return dict(salient=salient_per_page(cfg), salient_bits=SALIENT_BITS)

    def page_shapes(self, g: PageGeometry, **sizes) -> Shapes:
        return zipcache_shapes(g, **sizes)

    def frame_shapes(self, g: PageGeometry) -> Shapes:
        # the attention each frame token has received from its page's queries so far (reset when offset 0 is
        # written)
        return {"ov_score": ((g.G, g.H), torch.float32)}

    def stats(self, cfg, sizes: dict[str, int]) -> dict:
        return {"salient_per_page": sizes["salient"], "salient_bits": sizes["salient_bits"]}


FORMAT = ZipCache()
