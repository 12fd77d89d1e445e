"""Decode attention page by page over the batch's own pages, scales folded into the query and the weights: kvq_torch's
decode for formats whose base is codes, scales and zeros only (kivi; `supports`).

A base key is k = z + c * s per page and channel, a base value v = z' + c' * s' per token and channel group, so

    q . k_t = (q * s_page) . c_t + q . z_page        sum_t p_t v_t = sum_t (p_t * s'_t) c'_t + sum_t p_t z'_t

and the context is never dequantized: the one pass over its size turns the codes into fp32 for the two matmuls,
one small matmul per (KV head, page), and every scale multiplies a query row or an attention weight instead. Nothing
is padded: the fp16 overlay frames are more units beside the pages, and the softmax runs per request over its units
by segment reductions. attention_batched.py (the padded, dequantized layout) serves the formats with per-page
extras and stays this path's cross-check; attention_ref.ref_decode is the oracle of both.

Why: on ragged batches the padded layout dequantizes B x the longest context, and those dequantizing passes were most
of a layer's decode attention (docs/knobs.md, "Fixed thresholds"; docs/results.md, "Where a decode step's time goes").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kvq.attention_ref import visible_from
from sgl_kvq.formats.registry import of_extras
from sgl_kvq.padded import Workspace, frame_rows, gather_rows, unpacked_codes
from sgl_kvq.plan import LayerKV, PagedPlan


def supports(kv: LayerKV) -> bool:
    """Whether kv's format is codes, scales and zeros only (PageCodec.plain_pages): a format whose extras change the
    dequantized K/V goes through attention_batched's padded layout."""
    return of_extras(kv.extras).codec.plain_pages


# When this path does less work than the padded one: it wins where the padded layout pads or the batch holds many
# tokens, and loses its extra small ops on short uniform batches (docs/knobs.md, "Fixed thresholds";
# bench/results/decode-paths-smollm2.json).
PADDED_OVER_REAL = 1.2  # padded units per real unit above which the page path wins
MANY_TOKENS = 4096  # real context tokens in the batch from which it wins anyway


def pays_off(plan: PagedPlan, G: int) -> bool:
    """Whether a decode plan is one this path runs faster than attention_batched's padded layout (above)."""
    n = plan.kv_indptr.diff() + plan.ov_indptr.diff()  # units per request
    units = int(n.sum())
    return plan.batch_size * int(n.max()) > PADDED_OVER_REAL * units or units * G >= MANY_TOKENS


@dataclass
class PageIndex:
    """A decode batch's units, built once per batch and reused by every layer: its NP base pages (plan.kv_indices
    order) then its NF overlay frames (plan.ov_indices order); units of one request need not be adjacent."""
    pages: int  # NP
    unit_req: torch.Tensor  # [NP + NF] int64 request of each unit
    unit_pos: torch.Tensor  # [NP + NF] int64 position of each unit's first token in its request's context
    last_pos: torch.Tensor  # [B] int64 position of each request's query (its context's last token)
    # [n] int64 positions u * G + t past their request's context (the tail of its last unit), in units (scores)
    # and in base pages (value scales: the pool may hold anything there)
    tail: torch.Tensor
    base_tail: torch.Tensor
    ov_tail: torch.Tensor  # ... in overlay frames (f * G + t, f counted from the first frame)
    slot_rows: torch.Tensor  # [H * NP * G] int64 head-major rows (padded.BatchedContext) of base slots
    page_rows: torch.Tensor  # [H * NP] int64 ... of base pages
    frame_rows: torch.Tensor  # [H * NF * G] int64 ... of overlay rows (frame * G + offset)


def index(plan: PagedPlan, G: int, H: int) -> PageIndex:
    """The units of a decode plan (one host read: the unit counts that size the index)."""
    dev = plan.kv_indptr.device
    reqs = torch.arange(plan.batch_size, device=dev)
    offs = torch.arange(G, device=dev)
    heads = torch.arange(H, device=dev)[:, None]

    def units(indptr, indices, last_len):
        n = indptr.long().diff()
        req = reqs.repeat_interleave(n)
        last = torch.zeros(req.numel(), dtype=torch.bool, device=dev)
        last[indptr.long()[1:][n > 0] - 1] = True
        used = torch.where(last, last_len.long()[req], G)
        pos = (torch.arange(req.numel(), device=dev) - indptr.long()[req]) * G  # from the list's first unit
        length = torch.where(n > 0, (n - 1) * G + last_len.long(), 0)
        return indices.long(), req, (offs[None, :] >= used[:, None]).reshape(-1).nonzero().squeeze(1), pos, length

    pages, page_req, base_tail, page_pos, base_len = units(plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len)
    frames, frame_req, ov_tail, frame_pos, ov_len = units(plan.ov_indptr, plan.ov_indices, plan.ov_last_page_len)

    def head_rows(idx):
        return (idx.reshape(1, -1) * H + heads).reshape(-1)

    NP = pages.numel()
    return PageIndex(pages=NP, unit_req=torch.cat([page_req, frame_req]),
                     unit_pos=torch.cat([page_pos, base_len[frame_req] + frame_pos]), last_pos=base_len + ov_len - 1,
                     tail=torch.cat([base_tail, NP * G + ov_tail]),
                     base_tail=base_tail, ov_tail=ov_tail, slot_rows=head_rows((pages[:, None] * G + offs).reshape(-1)),
                     page_rows=head_rows(pages), frame_rows=head_rows((frames[:, None] * G + offs).reshape(-1)))


def decode(q: torch.Tensor, kv: LayerKV, idx: PageIndex, sm_scale: float, ws: Workspace | None = None,
           window: int = -1) -> torch.Tensor:
    """q [B, Hq, D]: one query per request over its context (within `window`, attention_ref) -> [B, Hq, D] in q's
    dtype (kv: `supports`)."""
    B, Hq, D = q.shape
    G, H = kv.G, kv.ov_k.shape[2]
    g, NP = Hq // H, idx.pages
    NF = idx.unit_req.numel() - NP
    page_req, frame_req = idx.unit_req[:NP], idx.unit_req[NP:]
    qg = (q.float() * sm_scale).view(B, H, g, D).transpose(0, 1)  # [H, B, g, D]: query head i reads KV head i // g

    def fp32(codes, bits, name):  # [H, NP, G, D] fp32 codes of the batch's base slots, in ws's buffer when given
        c = unpacked_codes(codes, idx.slot_rows, bits).view(H, NP, G, D)
        return c.float() if ws is None else ws.take(name, c.shape, c.device).copy_(c)

    # Scores [H, unit, g, G]: base pages with the key scale folded into the query, then the overlay frames as stored.
    qu = qg[:, idx.unit_req]  # [H, NU, g, D]: each unit's request's queries
    qp = qu[:, :NP]
    ks = gather_rows(kv.k_scale, idx.page_rows, H).float()[:, :, None]  # [H, NP, 1, D]
    kz = gather_rows(kv.k_zero, idx.page_rows, H).float()[:, :, None]
    s_base = torch.matmul(qp * ks, fp32(kv.k_codes, kv.k_bits, "k").transpose(-1, -2))  # [H, NP, g, G]
    s_base += (qp * kz).sum(-1, keepdim=True)
    ov_k = frame_rows(kv.ov_k, idx.frame_rows).view(H, NF, G, D).float()
    s = torch.cat([s_base, torch.matmul(qu[:, NP:], ov_k.transpose(-1, -2))], 1)  # [H, NU, g, G]
    s.permute(1, 3, 0, 2)[idx.tail // G, idx.tail % G] = float("-inf")
    if window >= 0:  # positions before the window: weight 0 (a request's max comes from its query's own unit)
        hidden = idx.unit_pos[:, None] + torch.arange(G, device=q.device) < visible_from(idx.last_pos, window)[
            idx.unit_req][:, None]  # [NU, G]
        s.masked_fill_(hidden[None, :, None, :], float("-inf"))
    # Softmax per request over its units, normalized at the end.
    m = s.new_full((H, B, g), float("-inf")).scatter_reduce_(1, idx.unit_req[None, :, None].expand(H, -1, g),
                                                             s.amax(-1), "amax")
    e = s.sub_(m[:, idx.unit_req, :, None]).exp_()  # [H, NU, g, G]; 0 past each context
    denom = s.new_zeros(H, B, g).index_add_(1, idx.unit_req, e.sum(-1))
    # Values: per-token scale and zero folded into the weights, group by group (D // VG groups).
    e_base = e[:, :NP]
    groups = kv.v_scale.shape[-1]
    vs, vz = (gather_rows(x, idx.slot_rows, H).float().index_fill_(1, idx.base_tail, 0).view(H, NP, G, groups)
              for x in (kv.v_scale, kv.v_zero))
    vf = fp32(kv.v_codes, kv.v_bits, "v")
    if groups == 1:
        o_base = torch.matmul(e_base * vs.view(H, NP, 1, G), vf)[:, :, :, None]  # [H, NP, g, 1, D]
    else:
        vf = vf.view(H, NP, G, groups, D // groups)
        o_base = torch.stack([torch.matmul(e_base * vs[:, :, None, :, j], vf[..., j, :]) for j in range(groups)],
                             3)  # [H, NP, g, groups, VG]
    o_base += torch.matmul(e_base, vz)[..., None]
    # Overlay values as stored, positions past a context zeroed (the pool may hold anything there).
    ov_v = frame_rows(kv.ov_v, idx.frame_rows).float().index_fill_(1, idx.ov_tail, 0)
    out = s.new_zeros(H, B, g, D).index_add_(1, page_req, o_base.view(H, NP, g, D))
    out.index_add_(1, frame_req, torch.matmul(e[:, NP:], ov_v.view(H, NF, G, D)))
    out /= denom[..., None]
    return out.transpose(0, 1).reshape(B, Hq, D).to(q.dtype)
