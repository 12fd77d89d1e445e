"""Which overlay frames each request slot owns: the frame table every plan builder reads.

A running request keeps its open page and its R/G window pages in fp16 frames (`ring` of them, KVQConfig.ring_pages);
its logical page n lives in frame `slot_frames[r, n % ring]`, so its last `ring` pages never collide. Two ways to
back the frames (sgl_kvq/layout.py has the bytes):

  pooled  the frames are carved from the pool's own pages: frame f is the memory of pool pages f*k .. f*k+k-1 (the
          fp16 frame viewed over their packed codes, k = pages_per_frame), handed out by the page allocator while a
          request holds a request slot and given back when the slot is freed (patches/frames.py). An idle server
          keeps every page for tokens; a running request costs k*ring pages of the budget, charged where SGLang
          admits it. Frame 0 (pages 0 .. k-1) is the padded rows' dummy frame: every slot without frames points
          at it, and since page 0 (SGLang's dummy page) is never free, it is never handed out. A padded row is a
          one-token context (offset 0), so it writes only the frame's first row, which lies in page 0 while
          k <= G (can_pool); pages 1 .. k-1 serve tokens like any other.
  static  every request slot owns frames r*ring .. r*ring+ring-1 for the server's life, in a separate region sized
          for all slots (layout.frame_of): under prefill/decode disaggregation (SGLang sends a slot's frames as one
          row of its per-request state, which needs them at fixed places).

Pooled, a request slot may own `extra` frames beyond its ring: its decode strategy's per-request state, carved and
charged with the ring (SpeCache's prefetched top-k rows: sgl_kvq/specache/topk_rows.py), addressed by request slot
through `extra_frames` [R, extra] (0 while the slot holds none) and never read as overlay frames.

Frames are layer-independent; their contents are per layer (ov_k / ov_v). A frame is read only through its own
slot's plan and only while its (tag, generation) still names the page (metadata/host.py), so a frame's previous
owner never leaks into a new one: assign() empties its tags.
"""

from __future__ import annotations

import torch

from sgl_kvq.layout import frame_of

from sgl_kvq.pool_shape import PoolShape


def can_pool(shape: PoolShape, model_dtype: torch.dtype) -> bool:
    """Whether the padded rows' writes to dummy frame 0 (its first row) stay inside page 0: k <= G. (A frame that is
    no whole number of pages, 3-bit codes of 64 channels, takes k rounded up: frame_view lays frames k pages apart.)"""
    return shape.pages_per_frame(model_dtype) <= shape.G


def frame_view(codes: torch.Tensor, num_frames: int, G: int, H: int, D: int,
               model_dtype: torch.dtype) -> torch.Tensor:
    """Pooled frames over a pool's codes [L, S, H, Dp] (or one layer's [S, H, Dp]; uint8, num_frames * k whole
    pages) -> [L, F, G, H, D] (or [F, G, H, D]) in the model dtype: frame f at the start of its k pages' bytes.
    Contiguous where a frame fills its pages; at 3 bits (k pages hold more than a frame) frames are k pages' bytes
    apart and each frame is contiguous."""
    lead = tuple(codes.shape[:-3])
    frame_bytes = G * H * D * torch.empty((), dtype=model_dtype).element_size()
    return codes.view(*lead, num_frames, -1)[..., :frame_bytes].view(model_dtype).view(*lead, num_frames, G, H, D)


def pooled_frames(shape: PoolShape, model_dtype: torch.dtype, disaggregation_mode: str) -> bool:
    """Frames are pooled where KVQ_FRAMES=pooled asks for it, unless SGLang's prefill/decode disaggregation sends them
    as one row of its per-request state (indexed by request slot: sgl_kvq/pd_transfer.py) or a frame spans more pages
    than a page has tokens."""
    return shape.cfg.frames == "pooled" and disaggregation_mode not in ("prefill", "decode") \
        and can_pool(shape, model_dtype)


class FrameTable:
    def __init__(self, num_req_slots: int, ring: int, num_frames: int, device: torch.device, *, pooled: bool,
                 extra: int = 0):
        if extra and not pooled:
            raise AssertionError("sgl_kvq: only pooled frames carry a strategy's extra frames")
        self.ring, self.extra, self.pooled, self.num_frames = ring, extra, pooled, num_frames
        self.per_request = ring + extra  # pooled: frames a running request takes
        slots = torch.arange(num_req_slots)[:, None]
        static = frame_of(slots, torch.arange(ring)[None, :], ring)
        # host copy first: the host-side builders index it per request; the device copy serves the device builder
        self.host = torch.zeros_like(static) if pooled else static
        self.slot_frames = self.host.to(device)
        self.extra_frames = torch.zeros((num_req_slots, extra), dtype=torch.int64, device=device)
        self.owned: dict[int, list[int]] = {}  # pooled: slot -> its frames (ring, then extra)

    def of(self, req_slot, logical_page):
        """Frame of request slot `req_slot`'s logical page (integer tensors, which broadcast, on the table's device)."""
        return self.slot_frames[req_slot, logical_page % self.ring]

    def of_host(self, req_slot: int, logical_page: int) -> int:
        return int(self.host[req_slot, logical_page % self.ring])

    def holds(self, req_slot: int) -> bool:
        return not self.pooled or req_slot in self.owned

    def assign(self, req_slot: int, frames: list[int], ov_tag: torch.Tensor) -> None:
        """Pooled: request slot `req_slot` owns `frames` (per_request of them: its ring, then its extra frames; none
        of them frame 0) from now on."""
        if not self.pooled or req_slot in self.owned or len(frames) != self.per_request or 0 in frames:
            raise AssertionError(f"sgl_kvq: cannot give frames {frames} to request slot {req_slot}")
        ids = torch.tensor(frames, dtype=torch.int64)
        ov_tag[ids.to(ov_tag.device)] = -1
        self.host[req_slot] = ids[:self.ring]
        self.slot_frames[req_slot] = ids[:self.ring].to(self.slot_frames.device)
        self.extra_frames[req_slot] = ids[self.ring:].to(self.extra_frames.device)
        self.owned[req_slot] = list(frames)

    def release(self, req_slot: int) -> list[int]:
        """Pooled: the slot's frames, now owned by nobody (its rows point at the dummy frame again)."""
        frames = self.owned.pop(req_slot, [])
        if frames:
            self.host[req_slot] = 0
            self.slot_frames[req_slot] = 0
            self.extra_frames[req_slot] = 0
        return frames

    def release_all(self) -> None:
        self.owned.clear()
        if self.pooled:
            self.host.zero_()
            self.slot_frames.zero_()
            self.extra_frames.zero_()

    def frames_held(self) -> int:
        return sum(len(f) for f in self.owned.values())
