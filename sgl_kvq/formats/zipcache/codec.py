"""ZipCache on one page of G tokens: the exact format of a zipcache2 base page (see sgl_kvq/layout.py).

Per page and KV head, with NS = salient tokens per page (salient_per_page below) picked by
saliency (below):
    c   sqrt(max_t |V[t, d]|) per channel over the page's G tokens, fp16 (ZipCache's channel-separable token-wise
        value quantization: V / c is quantized per token, read back times c; floored at 1e-3 so a zero channel
        divides safely).
    D   KIVI's packed 2-bit page of (K with the salient rows replaced by each channel's median over the
        non-salient tokens, V / c): the key scales span only the non-salient class (ZipCache's per-class
        channel-wise key scales). The salient rows' 2-bit codes are stored and unused.
    S   the NS salient rows at 4 bit: key codes per channel over those rows (scale/zero [D]), value codes of V / c
        per row and value group, and their token offsets (uint8): the per-token precision map.
Read back: K_hat = D's keys with the salient rows replaced by S's; V_hat = (D's values with S's rows) * c. All of it
is per page and immutable, so a page the radix tree shares reads the same for every request.

Saliency (ZipCache's normalized attention score, section 4) from the page's own queries: the query at page offset o
attends causally to the page's tokens 0..o (softmax over them); the score of token t is the attention it received,
summed over the queries and over the query heads of its KV head, divided by the (query, query head) pairs that could
see it, (G - t) * group. `received_attention` computes one batch's share; the store accumulates it per overlay
frame (sgl_kvq/kv_store.py), so a page's score does not depend on how its tokens were batched.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sgl_kvq.formats.page_codec import PageCodec, PageWrite
from sgl_kvq.quant import kivi_page, pack, uniform
from sgl_kvq.quant.uniform import SCALE_DTYPE

SALIENT_BITS = 4
_C_FLOOR = 1e-3


class SalientPlane(NamedTuple):
    """Per page n, KV head h (all per page: the pool stores them [P, ...])."""
    v_chan: torch.Tensor  # [N, H, D] fp16: c, the value channel scale (values read back as (V / c)_hat * c)
    s_idx: torch.Tensor  # [N, H, NS] uint8: the salient rows' token offsets in the page
    s_k_codes: torch.Tensor  # [N, H, NS, D * 4 // 8] uint8: their keys at 4 bit
    s_k_scale: torch.Tensor  # [N, H, D] fp16: per channel over the salient rows
    s_k_zero: torch.Tensor  # [N, H, D] fp16
    s_v_codes: torch.Tensor  # [N, H, NS, D * 4 // 8] uint8: their V / c at 4 bit
    s_v_scale: torch.Tensor  # [N, H, NS, D // VG] fp16: per row and value group
    s_v_zero: torch.Tensor  # [N, H, NS, D // VG] fp16


def salient_count(ratio: float, G: int) -> int:
    """NS = round(ratio * G), at least 1 (the config refuses ratios that give none or all)."""
    return max(1, round(ratio * G))


def received_attention(q: torch.Tensor, present: torch.Tensor, k: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """Attention each page token receives from the page's queries given here.

    q [N, G, Hq, D] queries by page offset, present [N, G] bool (which offsets have a query in this batch), k [N, G,
    H, D] the page's keys (rows past a query's offset are masked, so they may be stale) -> [N, G, H] fp32: for key t,
    the sum over present queries o >= t and the query heads of its KV head of softmax_{0..o}(q_o . k / sqrt)."""
    N, G, Hq, D = q.shape
    H = k.shape[2]
    qg = q.float().view(N, G, H, Hq // H, D)
    s = torch.einsum("nohgd,nthd->nhgot", qg, k.float()) * sm_scale  # [N, H, g, G(o), G(t)]
    causal = torch.ones(G, G, dtype=torch.bool, device=q.device).tril()
    p = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1)
    # where, not a product: an absent query's row may see stale frame rows (NaN times 0 is NaN)
    p = torch.where(present[:, None, None, :, None], p, 0.0)
    return p.sum(dim=(2, 3)).transpose(1, 2).contiguous()  # [N, G(t), H]


def normalize(received: torch.Tensor, group: int) -> torch.Tensor:
    """received [N, G, H] over all G queries of the page -> the normalized score: / ((G - t) * group)."""
    G = received.shape[1]
    seen_by = (G - torch.arange(G, device=received.device, dtype=torch.float32)) * group
    return received / seen_by[None, :, None]


def select_salient(score: torch.Tensor, ns: int) -> torch.Tensor:
    """score [N, G, H] -> [N, H, NS] int64 offsets of each head's NS highest scores, ascending by offset."""
    return score.topk(ns, dim=1).indices.transpose(1, 2).sort(dim=-1).values.contiguous()


def _masked_median(x: torch.Tensor, salient: torch.Tensor, ns: int) -> torch.Tensor:
    """x [N, G, H, D], salient [N, G, H, 1] bool -> [N, 1, H, D]: each channel's lower median over the G - ns
    non-salient tokens (salient rows pushed to +inf sort last; torch.median's lower median)."""
    G = x.shape[1]
    filled = x.masked_fill(salient, float("inf"))
    return filled.kthvalue((G - ns - 1) // 2 + 1, dim=1, keepdim=True).values


def pack_zipcache_pages(k: torch.Tensor, v: torch.Tensor, idx: torch.Tensor, bits: int, value_group: int, *,
                        specache_one_bit: bool = True) -> tuple[kivi_page.PackedPages, SalientPlane]:
    """k, v [N, G, H, D] complete pages, idx [N, H, NS] salient offsets (select_salient) -> (the KIVI base, the
    salient plane)."""
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"expected k, v [N, G, H, D] of one shape, got {tuple(k.shape)} {tuple(v.shape)}")
    N, G, H, D = k.shape
    ns = idx.shape[-1]
    k, v = k.float(), v.float()
    idx = idx.long()
    salient = torch.zeros(N, G, H, 1, dtype=torch.bool, device=k.device)
    salient.scatter_(1, idx.transpose(1, 2)[..., None], True)
    k_fill = torch.where(salient, _masked_median(k, salient, ns), k)
    c = v.abs().amax(dim=1).sqrt().clamp_min(_C_FLOOR).to(SCALE_DTYPE)  # [N, H, D]
    vn = v / c[:, None].float()
    base = kivi_page.pack_pages(k_fill, vn, bits, value_group, specache_one_bit=specache_one_bit)
    rows = idx[..., None].expand(N, H, ns, D)
    ks = k.transpose(1, 2).gather(2, rows)  # [N, H, NS, D]
    vs = vn.transpose(1, 2).gather(2, rows)
    kq = uniform.quantize(ks, SALIENT_BITS, dims=2)
    vq = uniform.quantize_channel_groups(vs, SALIENT_BITS, value_group)
    plane = SalientPlane(c, idx.to(torch.uint8), pack.pack(kq.codes, SALIENT_BITS), kq.scale.squeeze(2),
                         kq.zero.squeeze(2), pack.pack(vq.codes, SALIENT_BITS), vq.scale, vq.zero)
    return base, plane


def salient_rows(s: SalientPlane) -> tuple[torch.Tensor, torch.Tensor]:
    """The salient rows dequantized: keys and V / c, each [N, H, NS, D] fp32."""
    k = uniform.dequantize(pack.unpack(s.s_k_codes, SALIENT_BITS), s.s_k_scale[:, :, None], s.s_k_zero[:, :, None])
    v = uniform.dequantize_channel_groups(pack.unpack(s.s_v_codes, SALIENT_BITS), s.s_v_scale, s.s_v_zero)
    return k, v


def apply_salient(k_hat: torch.Tensor, v_hat: torch.Tensor, s: SalientPlane) -> tuple[torch.Tensor, torch.Tensor]:
    """k_hat, v_hat [N, G, H, D] fp32, the pages' dequantized base (v_hat is V / c) -> the pages read back, in
    place: salient rows replaced, values multiplied by c."""
    ks, vs = salient_rows(s)
    rows = s.s_idx.long().transpose(1, 2)[..., None].expand(-1, -1, -1, k_hat.shape[-1])  # [N, NS, H, D]
    k_hat.scatter_(1, rows, ks.transpose(1, 2))
    v_hat.scatter_(1, rows, vs.transpose(1, 2))
    v_hat.mul_(s.v_chan[:, None].float())
    return k_hat, v_hat


def dequantize_zipcache_pages(base: kivi_page.PackedPages, s: SalientPlane, bits: int) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
    k_hat, v_hat = kivi_page.dequantize_pages(base, bits)
    return apply_salient(k_hat, v_hat, s)


def select_pages(pool: SalientPlane, pages: torch.Tensor) -> SalientPlane:
    """The pool's plane of one layer -> that of pool pages `pages` [N]."""
    return SalientPlane(*(t[pages] for t in pool))


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
    recv = received_attention(qp, present, k, sm_scale)
    starts = torch.zeros(n, dtype=torch.int32, device=q.device).index_add_(0, tile, (offs == 0).int()) > 0
    return torch.where(starts[:, None, None], 0.0, earlier) + recv


class ZipCacheCodec(PageCodec):
    needs_queries = True
    plain_pages = False

    def pack(self, cfg, value_group: int, k, v, w: PageWrite, tables: dict):
        idx = select_salient(normalize(w.received, w.group), salient_per_page(cfg))
        return pack_zipcache_pages(k, v, idx, cfg.bits, value_group, specache_one_bit=cfg.specache_one_bit)

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
        return apply_salient(k, v, select_pages(extras, pages))

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
