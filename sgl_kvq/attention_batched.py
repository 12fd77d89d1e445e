"""Batched decode attention over the packed paged base plus the fp16 overlay: the compute of `kvq_torch` decode.

Same result as attention_ref.ref_decode (its oracle; tests/unit/test_attention_batched.py, fp32 within 1e-5) without a
Python loop over requests. A per-batch index (`BatchedContext`, built once, reused by every layer) places each
request's context in a padded, head-major layout [H, B, T, D] (T: the longest context in whole pages); per layer
the batch's base pages are unpacked straight into that layout by one table lookup (only the pages the batch
references, never the pool), dequantized in place, the overlay tokens copied over their positions, and one masked
attention runs over the batch, GQA by reshaping the query heads (no repeat_interleave).

Why this shape (SmolLM2 geometry, B=8, 1k-token contexts, one CPU thread): the per-request reference spends most of
its time in small-op overhead and repeat_interleave; gathering rows into a token-major table and padding it after
doubled the bytes moved (einsum copied the padded [B, T, H, D] into bmm's layout), so the lookup writes the final
layout directly and the matmuls read it as is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from sgl_kvq.attention_ref import visible_from
from sgl_kvq.formats.registry import of_extras
from sgl_kvq.plan import LayerKV, PagedPlan
from sgl_kvq.quant import pack


@dataclass
class BatchedContext:
    """Request b's context position t sits at padded position b * T + t (T = units * G)."""
    units: int  # pages per request in the padded layout (the longest context's page count)
    slots: torch.Tensor  # [B * T] int64 pool slot of each base token position; 0 elsewhere
    pages: torch.Tensor  # [B, units] int64 base page of each page position; 0 elsewhere
    is_base_page: torch.Tensor  # [B, units] bool
    is_base_tok: torch.Tensor  # [B * T] bool
    ov_rows: torch.Tensor  # [N] int64 overlay rows (frame * G + offset) of the batch's overlay tokens
    ov_dst: torch.Tensor  # [N] int64 their padded positions
    valid: torch.Tensor  # [B, T] bool, t < b's context length
    length: torch.Tensor  # [B] int64 b's context length
    base_len: torch.Tensor  # [B] int64: b's positions t < base_len[b] come from the packed base, the rest are frames
    # Head-major row indices into a layer's [S * H, ...] / [P * H, ...] / [F * G * H, ...] views: row h * n + i
    # is head h of the i-th slot / page / overlay row. One index_select then gathers straight into the [H, ...]
    # layout (B=1, 1k tokens, SmolLM2: 8 us against 115 us for codes[slots].transpose(0, 1).contiguous()).
    slot_rows: torch.Tensor  # [H * B * T] int64
    page_rows: torch.Tensor  # [H * B * units] int64
    ov_head_rows: torch.Tensor  # [H * N] int64


def prepare(plan: PagedPlan, G: int, H: int) -> BatchedContext:
    """The padded layout of a decode batch's contexts (one host read per batch: the page count that sizes it);
    H: KV heads (the head-major row indices)."""
    kv_indptr, ov_indptr = plan.kv_indptr.long(), plan.ov_indptr.long()
    n_pages, n_frames = kv_indptr.diff(), ov_indptr.diff()
    base_len = torch.where(n_pages > 0, (n_pages - 1) * G + plan.kv_last_page_len.long(), 0)
    ov_len = torch.where(n_frames > 0, (n_frames - 1) * G + plan.ov_last_page_len.long(), 0)
    length = base_len + ov_len
    B = length.numel()
    units = int((n_pages + n_frames).max()) if B else 0
    dev = length.device
    u = torch.arange(units, device=dev)[None, :]
    is_base_page = u < n_pages[:, None]
    pages = torch.where(is_base_page, plan.kv_indices.long()[(kv_indptr[:-1, None] + u).clamp(max=max(
        plan.kv_indices.numel() - 1, 0))] if plan.kv_indices.numel() else 0, 0)
    t = torch.arange(units * G, device=dev)[None, :]
    valid = t < length[:, None]
    is_base_tok = (t < base_len[:, None]).reshape(-1)
    slots = torch.where(is_base_tok, (pages[:, :, None] * G + torch.arange(G, device=dev)).reshape(-1), 0)
    in_ov = (valid & (t >= base_len[:, None])).reshape(-1)
    ov_dst = in_ov.nonzero().squeeze(1)
    b, t_ov = ov_dst // (units * G), ov_dst % (units * G)
    j = t_ov - base_len[b]  # position within b's overlay
    ov_rows = plan.ov_indices.long()[ov_indptr[b] + j // G] * G + j % G if ov_dst.numel() else ov_dst
    heads = torch.arange(H, device=dev)[:, None]

    def head_rows(idx):
        return (idx.reshape(1, -1) * H + heads).reshape(-1)

    return BatchedContext(units, slots, pages, is_base_page, is_base_tok, ov_rows, ov_dst, valid, length, base_len,
                          head_rows(slots), head_rows(pages), head_rows(ov_rows))


class Workspace:
    """fp32 buffers reused by every layer and step for the padded K and V, grown when a batch needs more.

    Allocated per layer (2 x 6.7 MB at B=8, 1k tokens, SmolLM2), glibc sometimes returned them to the OS and
    faulted them back in on every call: one such process took 51k minor page faults and 90 ms of system time per
    118 ms decode step, another none (52-57 ms). Reused buffers cannot fault; in the steady state they time the same
    (bench: B=1..16, 256-1344 tokens, within 8%)."""

    def __init__(self):
        self._bufs: dict[str, torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        n = math.prod(shape)
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < n or buf.device != device:
            buf = self._bufs[name] = torch.empty(n, dtype=torch.float32, device=device)
        return buf[:n].view(shape)


def _rows(x: torch.Tensor, rows: torch.Tensor, H: int) -> torch.Tensor:
    """x [N, H, ...] gathered at head-major rows (BatchedContext) -> [H, len(rows) // H, ...]."""
    return x.reshape(-1, *x.shape[2:]).index_select(0, rows).view(H, -1, *x.shape[2:])


def frame_rows(ov: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Overlay frames ov [F, G, H, D] gathered at head-major rows ((frame * G + offset) * H + head) -> [H, N, D].
    Pooled kivi3 frames lie k pages' bytes apart (sgl_kvq/frames.py frame_view), where a reshape to rows would copy
    every frame of the layer: rows are then found by frame and row within it."""
    F, G, H, D = ov.shape
    if ov.is_contiguous():
        return _rows(ov.view(F * G, H, D), rows, H)
    per = G * H
    return ov.view(F, per, D)[rows // per, rows % per].view(H, -1, D)


# Per (device, bits): byte value -> its 8 // bits codes in natural order, packed into one word (uint8 lanes of an
# int64 / int32 / int16: a little-endian word's byte i is element i).
_WORD_LUTS: dict[tuple[torch.device, int], torch.Tensor] = {}
_WORD = {1: torch.int64, 2: torch.int32, 4: torch.int16}


def unpacked_codes(codes: torch.Tensor, slot_rows: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [S, H, Dp] uint8 of one layer -> [H, N, D] uint8 codes of the N slots whose head-major rows are
    slot_rows (BatchedContext.slot_rows: the padded positions).

    One word gather per packed byte writes the codes in natural channel order, so the dequantize that follows
    reads one contiguous uint8 tensor. Why (one thread, SmolLM2, B=8, 1k tokens: [3, 8192, 16] packed bytes,
    thread time, ms): word table 0.09 / 0.16 / 0.32 at 1 / 2 / 4 bits; per-position shifts written
    interleaved into fp32 (8 // bits strided copies) 0.4-2.3. In the engine (2 OMP threads on a loaded 2-core
    machine) those strided copies were 63% of kivi2's decode step (py-spy on the scheduler)."""
    packed = _rows(codes, slot_rows, codes.shape[1])  # [H, N, Dp]: small, uint8
    if bits == 3:  # two planes (sgl_kvq.quant.pack): code = low | high << 2
        lo = pack.low_plane_bytes(packed.shape[2] * 8 // 3)
        high = _unpack_words(packed[..., lo:], 1).bitwise_left_shift_(2)
        return _unpack_words(packed[..., :lo], 2).bitwise_or_(high)
    return _unpack_words(packed, bits)


def _unpack_words(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[H, N, M] packed bytes of a power-of-two width -> [H, N, M * 8 // bits] uint8 codes."""
    key = (packed.device, bits)
    if key not in _WORD_LUTS:
        table = pack.unpack(torch.arange(256, dtype=torch.uint8, device=packed.device)[:, None], bits)
        _WORD_LUTS[key] = table.contiguous().view(_WORD[bits]).reshape(256)
    words = torch.index_select(_WORD_LUTS[key], 0, packed.reshape(-1).int())
    return words.view(torch.uint8).view(packed.shape[0], packed.shape[1], packed.shape[2] * 8 // bits)


def context(kv: LayerKV, ctx: BatchedContext, ws: Workspace | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's keys and values in the padded layout, k, v [H, B, T, D] fp32: base tokens read as the format
    reads them (Format.read_padded), overlay tokens as it reads those (Format.read_overlay), zeros at padding; in
    ws's buffers when given (valid until the next call)."""
    G, H, D = kv.G, kv.ov_k.shape[2], kv.ov_k.shape[3]
    B, units = ctx.pages.shape
    fmt = of_extras(kv.extras)
    k, v = fmt.read_padded(kv, ctx, ws)
    if ctx.ov_dst.numel():
        k_ov, v_ov = fmt.read_overlay(frame_rows(kv.ov_k, ctx.ov_head_rows), frame_rows(kv.ov_v, ctx.ov_head_rows))
        k.index_copy_(1, ctx.ov_dst, k_ov)
        v.index_copy_(1, ctx.ov_dst, v_ov)
    return k.view(H, B, units * G, D), v.view(H, B, units * G, D)


def kivi_padded(kv: LayerKV, ctx: BatchedContext, ws: Workspace | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """KIVI's base of the batch's pages in the padded layout k, v [H, B * U * G, D] fp32, zeros outside base
    positions (Format.read_padded's default)."""
    G, H, D = kv.G, kv.ov_k.shape[2], kv.ov_k.shape[3]
    B, units = ctx.pages.shape
    kc, vc = (unpacked_codes(c, ctx.slot_rows, kv.bits) for c in (kv.k_codes, kv.v_codes))
    # Keys: per page and channel, broadcast over the page's G tokens. Zero scale/zero outside base pages, so
    # padding holds zeros and overlay positions hold nothing until the overlay is copied over them.
    off = ~ctx.is_base_page[None, :, :, None]
    ks = _rows(kv.k_scale, ctx.page_rows, H).view(H, B, units, D).float().masked_fill_(off, 0)[:, :, :, None]
    kz = _rows(kv.k_zero, ctx.page_rows, H).view(H, B, units, D).float().masked_fill_(off, 0)[:, :, :, None]
    # codes * scale + zero in fp32 in one pass from the uint8 codes (the same two roundings as mul_ then add_)
    shape = (H, B, units, G, D)
    k = torch.empty(shape, device=kc.device) if ws is None else ws.take("k", shape, kc.device)
    torch.addcmul(kz, kc.view(shape), ks, out=k)  # ks, kz [H, B, U, 1, D]
    k = k.view(H, B * units * G, D)
    # Values: per token and channel group. In place on the fp32 codes: addcmul with a per-row scale broadcast
    # along the channels runs ~4x slower than mul_ + add_ (0.88 vs 0.22 ms, B=8 above).
    off = ~ctx.is_base_tok[None, :, None]
    vs = _rows(kv.v_scale, ctx.slot_rows, H).float().masked_fill_(off, 0)[..., None]  # [H, B * T, D/VG, 1]
    vz = _rows(kv.v_zero, ctx.slot_rows, H).float().masked_fill_(off, 0)[..., None]
    v = vc.float() if ws is None else ws.take("v", vc.shape, vc.device).copy_(vc)
    v.view(H, B * units * G, vs.shape[2], -1).mul_(vs).add_(vz)
    return k, v.view(H, B * units * G, D)


def visible(ctx: BatchedContext, window: int) -> torch.Tensor:
    """[B, T] bool: the padded positions each request's query sees (its context; the last window + 1 tokens of it
    under a sliding window, attention_ref)."""
    if window < 0:
        return ctx.valid
    t = torch.arange(ctx.valid.shape[1], device=ctx.valid.device)[None, :]
    return ctx.valid & (t >= visible_from(ctx.length - 1, window)[:, None])


def decode(q: torch.Tensor, kv: LayerKV, ctx: BatchedContext, sm_scale: float,
           ws: Workspace | None = None, window: int = -1) -> torch.Tensor:
    """q [B, Hq, D]: one query per request over its context (within `window`) -> [B, Hq, D] in q's dtype."""
    B, Hq, D = q.shape
    H = kv.ov_k.shape[2]
    k, v = context(kv, ctx, ws)
    qg = q.float().view(B, H, Hq // H, D).transpose(0, 1)  # [H, B, g, D]: query head i reads KV head i // g
    s = torch.matmul(qg, k.transpose(-1, -2)) * sm_scale  # [H, B, g, T]
    s.masked_fill_(~visible(ctx, window)[None, :, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v).transpose(0, 1).reshape(B, Hq, D).to(q.dtype)
