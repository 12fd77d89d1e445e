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
from sgl_kvq.formats.base import Format, PageWrite
from sgl_kvq.layout import PageGeometry, Shapes
from sgl_kvq.formats.zipcache import codec as zipcache_page
from sgl_kvq.quant.pack import packed_dim
from sgl_kvq.quant.uniform import SCALE_DTYPE
from sgl_kvq.formats.zipcache.codec import SALIENT_BITS, SalientPlane, salient_count, salient_rows


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


def salient_per_page(cfg) -> int:
    """NS: salient tokens per page and KV head."""
    return salient_count(cfg.params.salient, cfg.group_size)


def _page_queries(n: int, G: int, tile: torch.Tensor, offs: torch.Tensor, q: torch.Tensor):
    """q rows [M, Hq, D] at (tile [M], offs [M]) -> by page offset [n, G, Hq, D] and which are present [n, G]."""
    qp = q.new_zeros(n, G, *q.shape[1:])
    qp[tile, offs] = q
    present = torch.zeros(n, G, dtype=torch.bool, device=q.device)
    present[tile, offs] = True
    return qp, present


def _received(n: int, G: int, tile, offs, q, k, sm_scale, earlier):
    """Attention n pages' tokens received: this batch's queries q at (tile, offs) over the pages' keys k [n, G, H, D],
    plus `earlier` [n, G, H] where no page starts (offset 0 written) in this batch."""
    qp, present = _page_queries(n, G, tile, offs, q)
    recv = zipcache_page.received_attention(qp, present, k, sm_scale)
    starts = torch.zeros(n, dtype=torch.int32, device=q.device).index_add_(0, tile, (offs == 0).int()) > 0
    return torch.where(starts[:, None, None], 0.0, earlier) + recv


@dataclass(frozen=True)
class ZipCacheParams:
    # Share of each page's G tokens (per KV head) kept at 4 bit, NS = round(ratio * G). 0.4 puts zipcache2 at about
    # kivi4's bytes, so the two compare at equal memory (docs/knobs.md, KVQ_ZIPCACHE_SALIENT).
    salient: float = 0.4


class ZipCache(Format):
    family = "zipcache"
    bits = (2,)
    extras = SalientPlane
    kernel = "zipcache"
    # saliency and the median fill run in torch on both backends
    quantize_kernel = False
    needs_queries = True
    plain_pages = False
    params = ZipCacheParams
    knobs = {"KVQ_ZIPCACHE_SALIENT": ("salient", float)}

    def kernel_corrections(self) -> tuple:
        from sgl_kvq.formats.zipcache.kernel import _zipcache_kt, _zipcache_v

        return _zipcache_kt, _zipcache_v

    def check_params(self, params: ZipCacheParams, group_size: int) -> None:
        g = group_size
        if not 0 < params.salient < 1 or not 1 <= salient_count(params.salient, g) < g:
            raise KVQConfigError(f"sgl_kvq: KVQ_ZIPCACHE_SALIENT={params.salient} must be in (0, 1) and keep "
                                 f"between 1 and G-1={g - 1} of a page's {g} tokens salient, e.g. 0.4")

    def sizes(self, cfg, g: PageGeometry) -> dict[str, int]:
        return dict(salient=salient_per_page(cfg), salient_bits=SALIENT_BITS)

    def sizes_of(self, s: SalientPlane, g: PageGeometry) -> dict[str, int]:
        salient = s.s_idx.shape[-1]
        if not 1 <= salient < g.G:
            raise LayoutError(f"sgl_kvq kernels: zipcache2 needs 1..G-1 salient tokens per page, got {salient}")
        return dict(salient=salient, salient_bits=SALIENT_BITS)

    def page_shapes(self, g: PageGeometry, **sizes) -> Shapes:
        return zipcache_shapes(g, **sizes)

    def frame_shapes(self, g: PageGeometry) -> Shapes:
        # the attention each frame token has received from its page's queries so far (reset when offset 0 is
        # written)
        return {"ov_score": ((g.G, g.H), torch.float32)}

    def stats(self, cfg, sizes: dict[str, int]) -> dict:
        return {"salient_per_page": sizes["salient"], "salient_bits": sizes["salient_bits"]}

    def pack(self, cfg, value_group: int, k, v, w: PageWrite, tables: dict):
        idx = zipcache_page.select_salient(zipcache_page.normalize(w.received, w.group), salient_per_page(cfg))
        return zipcache_page.pack_zipcache_pages(k, v, idx, cfg.bits, value_group,
                                                 specache_one_bit=cfg.specache_one_bit)

    def page_write(self, store, layer, bw, q, kp, sm_scale, w: PageWrite) -> PageWrite:
        # earlier batches' share from the pages' frame accumulators, read before this batch updates them
        received = _received(w.pages.numel(), store.G, bw.done_tok_page, bw.done_tok_off, q[bw.done_tok_rows], kp,
                             sm_scale, store.ov_score[layer, bw.done_frames])
        return w._replace(received=received, group=q.shape[1] // kp.shape[2])

    def _accumulate(self, store, layer, frames, tile, offs, q, sm_scale) -> torch.Tensor:
        """Add what queries q [M, Hq, D] (already written to frames[tile] at offs) paid their pages' tokens to
        those frames' ov_score, which is reset first where offset 0 is written (a page starts). -> the totals."""
        total = _received(frames.numel(), store.G, tile, offs, q, store.ov_k[layer, frames], sm_scale,
                          store.ov_score[layer, frames])
        store.ov_score[layer, frames] = total
        return total

    def batch_frames_written(self, store, layer, bw, q, sm_scale) -> None:
        frames, inv = torch.unique(bw.frame_ids, return_inverse=True)
        self._accumulate(store, layer, frames, inv, bw.frame_offs, q[bw.frame_rows], sm_scale)

    def decode_frames_written(self, store, layer, dw, q, sm_scale) -> torch.Tensor:
        # every row's frame total is its page's score when the row completes it
        frames = dw.frame_ids.long()
        rows = torch.arange(frames.numel(), device=frames.device)
        return self._accumulate(store, layer, frames, rows, dw.frame_offs.long(), q, sm_scale)

    def correct(self, k, v, extras, pages):
        return zipcache_page.apply_salient(k, v, zipcache_page.select_pages(extras, pages))

    def correct_padded(self, k, v, s: SalientPlane, ctx) -> None:
        """The salient rows replace theirs, then values are multiplied by their page's channel scale c, in
        apply_salient's order. Zeroed outside base pages (page 0 may hold anything; the overlay copy overwrites
        those positions, padding must stay finite)."""
        off = ~ctx.is_base_page[..., None, None, None]  # [B, U, 1, 1, 1]
        plane = SalientPlane(*(t[ctx.pages] for t in s))  # [B, U, H, ...]
        ks, vs = salient_rows(SalientPlane(*(t.flatten(0, 1) for t in plane)))  # [B * U, H, NS, D]
        B, U = ctx.pages.shape
        ks, vs = (x.view(B, U, *x.shape[1:]).masked_fill_(off, 0).permute(2, 0, 1, 3, 4) for x in (ks, vs))
        idx = plane.s_idx.long().masked_fill_(off[..., 0], 0).permute(2, 0, 1, 3)[..., None].expand_as(ks)
        k.scatter_(3, idx, ks)
        v.scatter_(3, idx, vs)
        v.mul_(plane.v_chan.float().masked_fill_(off[..., 0], 0).permute(2, 0, 1, 3)[:, :, :, None])


FORMAT = ZipCache()
