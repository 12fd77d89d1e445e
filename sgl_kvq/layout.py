"""The packed paged KV layout, written down once. The pool allocates it, the kernels read it, tests assert it.

A page is G = cfg.group_size consecutive token positions of ONE request (SGLang's paged allocator: position p sits at
in-page offset p % G) and is also the key quantization group. Token slot s lives in page s // G at offset s % G.
Page 0 (slots 0..G-1) is SGLang's dummy page for padded writes. L layers, H KV heads, D head dim, b bits,
VG = value channel group, Dp = D * b // 8 packed bytes per token-head (b = 3: a 2-bit plane of D // 4 bytes, then a
1-bit plane of D // 8 bytes; sgl_kvq.quant.pack). Under a recipe (kivimix, sgl_kvq/recipe.py) each layer's keys and
values have their own b, so k_codes and v_codes are one [S, H, Dp] tensor per layer (sgl_kvq/layer_tensors.py).

Base (complete pages, immutable once quantized; shared by the radix tree):
    k_codes  [L, S, H, Dp]      uint8   keys, b-bit codes packed along D (sgl_kvq.quant.pack)
    k_scale  [L, P, H, D]       fp16    per-channel over the page's G tokens: k ~= k_zero + code * k_scale
    k_zero   [L, P, H, D]       fp16
    v_codes  [L, S, H, Dp]      uint8   values, b-bit codes packed along D
    v_scale  [L, S, H, D // VG] fp16    per token, per group of VG channels
    v_zero   [L, S, H, D // VG] fp16
  with P = num_pages + 1 (page 0 included) and S = P * G token slots.
  Each format declares what its pages add beside these (Format.page_shapes, sgl_kvq/formats/<family>.py; the pool
  allocates them with the layer dim in front). Today's:
  gear2 / gearl2 pages also carry their correction (formats/gear/; r = cfg.params.rank, NK / NV =
  outliers per key channel / value token, 0 for gearl2):
    k_u, v_u  [L, P, H, r, G]   fp16    low-rank factor over the page's tokens
    k_w, v_w  [L, P, H, r, D]   fp16    ... over channels: correction = u^T @ w
    k_out_val [L, P, H, NK, D]  fp16    key channel d's outliers over the page
    k_out_idx [L, P, H, NK, D]  uint8   their token offsets
    v_out_val [L, S, H, NV]     fp16    value token's outliers over its channels
    v_out_idx [L, S, H, NV]     uint8   their channels
  logquant2 pages also carry M = logquant.codec.rows_per_page(cfg) fp16 row slots (formats/logquant/): the page's
  positions LogQuant's rule keeps when the page leaves the fp16 window, read instead of their codes:
    k_rows, v_rows [L, P, M, H, D] fp16    the tokens' K and V
    row_off   [L, P, M]         uint8   their in-page offsets, 255 for an empty slot
  zipcache2 pages carry their salient plane (formats/zipcache/; NS = zipcache.codec.salient_per_page(cfg) salient
  tokens per page and KV head, Ds = D * 4 // 8; values are stored as V / c and read back times c):
    v_chan    [L, P, H, D]      fp16    c = sqrt(max_t |V|) per channel over the page
    s_idx     [L, P, H, NS]     uint8   the salient tokens' offsets in the page (their base codes are unused)
    s_k_codes [L, P, H, NS, Ds] uint8   their keys at 4 bit
    s_k_scale, s_k_zero [L, P, H, D]            fp16  per channel over the salient rows
    s_v_codes [L, P, H, NS, Ds] uint8   their V / c at 4 bit
    s_v_scale, s_v_zero [L, P, H, NS, D // VG]  fp16  per salient row and value group

Overlay (fp16 tokens that override the base: the open page and the recent window), per running request:
    ov_k, ov_v [L, F, G, H, D]  model dtype
  request slot r (SGLang's req_pool_idx) owns `ring` = cfg.ring_pages frames; its logical page n (positions
  n*G .. n*G+G-1) uses frame slot_frames[r, n % ring] (sgl_kvq/frames.py), so its last `ring` pages never collide.
  Where the frames' memory is:
    pooled  ov_k / ov_v are k_codes / v_codes viewed in the model dtype: frame f is the code bytes of pool pages
            f*k .. f*k+k-1, k = pages_per_frame = ceil(D * elem_size / Dp) (8 at 2 bit in bf16), so P is a multiple
            of k and F = P / k. At 3 bits k pages hold more than a frame (6 pages in bf16, 5.33 used): frame f
            starts at its first page's bytes and frames are k pages' bytes apart (ov_k's dims 2..4 stay
            contiguous). A page is a token page or part of a frame, never both: the allocator hands out whole
            frames while a request runs (patches/frames.py). The scales and extras of a frame's pages go unused.
    static  a separate region of F = request slots * ring frames; slot r owns frame_of(r, n, ring) = r*ring + n%ring.
    ov_tag   [F]                int64   pool page whose tokens the frame holds (-1: empty)
    ov_gen   [F]                int64   that page's generation when the frame was written
    ov_score [L, F, G, H]       fp32    zipcache2's per-frame state (Format.frame_shapes): attention each frame
                                        token has received from its page's queries so far (the saliency
                                        accumulator, reset when offset 0 is written)
    page_gen [P]                int64   bumped whenever offset 0 of a page is written, i.e. when a freed page is
                                        reused: SGLang never tells the pool about frees, so a frame is valid only
                                        while (ov_tag, ov_gen) still names the page's current contents.
    pd_window [max_running_requests] int64  prefill/decode transfer only: how many of the slot's last frames hold its
                                        request's pages, counted by the prefill side and sent with the frames
                                        (sgl_kvq/pd_transfer.py)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kvq.quant.pack import packed_dim
from sgl_kvq.quant.uniform import SCALE_DTYPE


def frame_of(req_slot, logical_page, ring: int):
    """The overlay frame of request slot `req_slot`'s logical page `logical_page` (ints or integer tensors, which
    broadcast); ring = KVQConfig.ring_pages. The one definition: builders on the host and the device call it."""
    return req_slot * ring + logical_page % ring


Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True)
class PageGeometry:
    """One layer's page dims: P pages of G token slots (S = P * G), H KV heads, head dim D, NG value groups."""
    P: int
    G: int
    H: int
    D: int
    NG: int

    @property
    def S(self) -> int:
        return self.P * self.G


def kivi_shapes(g: PageGeometry, bits: int, v_bits: int | None = None) -> Shapes:
    """KIVI's base tensors of one layer (the layer dim removed), which every served format stores: keys at `bits`,
    values at `v_bits` (None: `bits`; a recipe's layer may differ, sgl_kvq/recipe.py)."""
    return {
        "k_codes": ((g.S, g.H, packed_dim(g.D, bits)), torch.uint8),
        "k_scale": ((g.P, g.H, g.D), SCALE_DTYPE),
        "k_zero": ((g.P, g.H, g.D), SCALE_DTYPE),
        "v_codes": ((g.S, g.H, packed_dim(g.D, v_bits or bits)), torch.uint8),
        "v_scale": ((g.S, g.H, g.NG), SCALE_DTYPE),
        "v_zero": ((g.S, g.H, g.NG), SCALE_DTYPE),
    }


def counts_as_value(name: str) -> bool:
    """Whether a pool tensor is counted with the values in the pool's K/V byte split (the rest, offsets and
    per-frame state included, count with the keys): v_*, s_v_* (a salient plane's), ov_v."""
    return name.startswith(("v_", "s_v_", "ov_v"))

