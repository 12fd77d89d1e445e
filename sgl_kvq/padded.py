"""The padded, head-major layout kvq_torch's batched decode reads (sgl_kvq/attention_batched.py): the per-batch
index that places each request's context in [H, B, T, D] (`BatchedContext`, built once per batch, reused by every
layer), the buffers every layer reuses, the row gathers, and KIVI's packed base dequantized straight into that
layout, which each format's padded read starts from (PageCodec.read_padded). Below the formats: it reads the packed
layout, never a format's declaration."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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


def gather_rows(x: torch.Tensor, rows: torch.Tensor, H: int) -> torch.Tensor:
    """x [N, H, ...] gathered at head-major rows (BatchedContext) -> [H, len(rows) // H, ...]."""
    return x.reshape(-1, *x.shape[2:]).index_select(0, rows).view(H, -1, *x.shape[2:])


def frame_rows(ov: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Overlay frames ov [F, G, H, D] gathered at head-major rows ((frame * G + offset) * H + head) -> [H, N, D].
    Pooled kivi3 frames lie k pages' bytes apart (sgl_kvq/frames.py frame_view), where a reshape to rows would copy
    every frame of the layer: rows are then found by frame and row within it."""
    F, G, H, D = ov.shape
    if ov.is_contiguous():
        return gather_rows(ov.view(F * G, H, D), rows, H)
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
    packed = gather_rows(codes, slot_rows, codes.shape[1])  # [H, N, Dp]: small, uint8
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


def kivi_padded(kv: LayerKV, ctx: BatchedContext, ws: Workspace | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """KIVI's base of the batch's pages in the padded layout k, v [H, B * U * G, D] fp32, zeros outside base
    positions (PageCodec.read_padded's default)."""
    G, H, D = kv.G, kv.ov_k.shape[2], kv.ov_k.shape[3]
    B, units = ctx.pages.shape
    kc, vc = (unpacked_codes(c, ctx.slot_rows, b) for c, b in ((kv.k_codes, kv.k_bits), (kv.v_codes, kv.v_bits)))
    # Keys: per page and channel, broadcast over the page's G tokens. Zero scale/zero outside base pages, so
    # padding holds zeros and overlay positions hold nothing until the overlay is copied over them.
    off = ~ctx.is_base_page[None, :, :, None]
    ks = gather_rows(kv.k_scale, ctx.page_rows, H).view(H, B, units, D).float().masked_fill_(off, 0)[:, :, :, None]
    kz = gather_rows(kv.k_zero, ctx.page_rows, H).view(H, B, units, D).float().masked_fill_(off, 0)[:, :, :, None]
    # codes * scale + zero in fp32 in one pass from the uint8 codes (the same two roundings as mul_ then add_)
    shape = (H, B, units, G, D)
    k = torch.empty(shape, device=kc.device) if ws is None else ws.take("k", shape, kc.device)
    torch.addcmul(kz, kc.view(shape), ks, out=k)  # ks, kz [H, B, U, 1, D]
    k = k.view(H, B * units * G, D)
    # Values: per token and channel group. In place on the fp32 codes: addcmul with a per-row scale broadcast
    # along the channels runs ~4x slower than mul_ + add_ (0.88 vs 0.22 ms, B=8 above).
    off = ~ctx.is_base_tok[None, :, None]
    vs = gather_rows(kv.v_scale, ctx.slot_rows, H).float().masked_fill_(off, 0)[..., None]  # [H, B * T, D/VG, 1]
    vz = gather_rows(kv.v_zero, ctx.slot_rows, H).float().masked_fill_(off, 0)[..., None]
    v = vc.float() if ws is None else ws.take("v", vc.shape, vc.device).copy_(vc)
    v.view(H, B * units * G, vs.shape[2], -1).mul_(vs).add_(vz)
    return k, v.view(H, B * units * G, D)
