"""SpeCache's prefetched top-k rows: per running request, layer and KV head, the K 16-bit K/V rows its next decode
step reads instead of their codes, and their positions, addressed through a table of frames by request slot:

    k, v   [L, F, C, H, D] model dtype   row j (of K) of request slot r, KV head h: frame table[r, j // C], row j % C
    pos    [L, F, C, H]    int64         that row's position in r's context; -1: nothing prefetched
    table  [R, m]          int64         r's frames, m = ceil(K / C)

Two ways to back the frames:
  pooled  the frames are pool frames (sgl_kvq/frames.py) a request takes with its overlay frames when it gets its
          request slot and gives back when the slot is freed (FrameTable's extra frames, charged at admission:
          patches/frames.py). k / v are those frames' fp16 views over the codes (store.ov_k / ov_v, C = G rows),
          pos the same frames' pages' key scales viewed as int64: a frame's k pages hold k*H*D fp16 key scales per
          layer, its positions take G*H int64 (specache2 in bf16: k = 8, so 8*64 scales per head hold 64 positions
          4 times over at D = 64, G = 64). What stays per request slot is its table row: O(1).
  static  a region of one frame of C = K rows per request slot (table[r] = [r]): static overlay frames, or a geometry
          whose positions do not fit a frame's scales (positions_fit).

A pooled frame holds garbage (its pages' last tokens) when a request takes it: every extend resets its slot's
positions (reset), and each decode step's first reader, the pre-decode, writes all K positions of every layer before
the two-lane step reads them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sgl_kvq.pool_shape import PoolShape
from sgl_kvq.quant.uniform import SCALE_DTYPE

POSITION_DTYPE = torch.int64


def positions_fit(shape: PoolShape, model_dtype: torch.dtype) -> bool:
    """Whether a pooled frame can hold G top-k rows: its fp16 view fills its k pages (frame_view is contiguous) and its
    pages' key scales (k*H*D fp16 per layer) hold the rows' G*H int64 positions."""
    k = shape.pages_per_frame(model_dtype)
    fills = k * shape.Dp == shape.head_dim * torch.empty((), dtype=model_dtype).element_size()
    return fills and shape.G * POSITION_DTYPE.itemsize <= k * shape.head_dim * SCALE_DTYPE.itemsize


def pooled_frames(top_k: int, shape: PoolShape, model_dtype: torch.dtype) -> int:
    """Pool frames one running request's top-k rows take (0: they cannot be pooled at this geometry)."""
    return -(-top_k // shape.G) if positions_fit(shape, model_dtype) else 0


def scale_positions(k_scale: torch.Tensor, num_frames: int, rows: int, heads: int) -> torch.Tensor:
    """int64 positions [L, F, rows, H] over the key scales [L, P, H, D] of each frame's pages (P = F * k): frame f's
    positions are the first rows*H*8 bytes of its k pages' scales."""
    L = k_scale.shape[0]
    n = rows * heads * POSITION_DTYPE.itemsize // k_scale.element_size()
    return k_scale.view(L, num_frames, -1)[:, :, :n].view(POSITION_DTYPE).view(L, num_frames, rows, heads)


class TopKRows:
    def __init__(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, table: torch.Tensor, top_k: int,
                 holds: Callable[[int], bool] | None = None):
        """holds (pooled): whether a request slot holds its frames now (a slot without them points at frame 0,
        whose pages serve tokens: never written through)."""
        self.k, self.v, self.pos, self.table, self.top_k = k, v, pos, table, top_k
        self.rows_per_frame = k.shape[2]
        self.pooled = holds is not None
        self._holds = holds
        if table.shape[1] * self.rows_per_frame < top_k:
            raise AssertionError(f"sgl_kvq: {table.shape[1]} frames of {self.rows_per_frame} rows cannot hold "
                                 f"top-{top_k}")

    @classmethod
    def static(cls, layers: int, num_req_slots: int, heads: int, head_dim: int, top_k: int, model_dtype: torch.dtype,
               device: torch.device) -> TopKRows:
        k = torch.zeros((layers, num_req_slots, top_k, heads, head_dim), dtype=model_dtype, device=device)
        pos = torch.full((layers, num_req_slots, top_k, heads), -1, dtype=POSITION_DTYPE, device=device)
        table = torch.arange(num_req_slots, device=device)[:, None]
        return cls(k, torch.zeros_like(k), pos, table, top_k)

    @classmethod
    def over_pool_frames(cls, store, top_k: int) -> TopKRows:
        """Pooled: the rows in the extra frames each running request takes (store.frames.extra of them)."""
        frames = store.frames
        if frames.extra < -(-top_k // store.G) or not positions_fit(store.shape, store.model_dtype):
            raise AssertionError(f"sgl_kvq: {frames.extra} extra frames cannot hold top-{top_k} rows")
        pos = scale_positions(store.k_scale, frames.num_frames, store.G, store.shape.heads)
        return cls(store.ov_k, store.ov_v, pos, frames.extra_frames, top_k, holds=frames.holds)

    # ---- addressing ----
    def _address(self, req: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(frames [B, K], rows [K]) of row j of request slots req [B]."""
        j = torch.arange(self.top_k, device=self.table.device)
        return self.table[req.long()][:, j // self.rows_per_frame], j % self.rows_per_frame

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One layer's (k, v [F, C, H, D], pos [F, C, H]) and the table: what the fused decode kernel reads."""
        return self.k[layer], self.v[layer], self.pos[layer], self.table

    def rows(self, layer: int, req: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies of request slots req [B]'s rows of `layer`: k, v [B, H, K, D], pos [B, H, K]."""
        fr, row = self._address(req)
        return (self.k[layer][fr, row].transpose(1, 2), self.v[layer][fr, row].transpose(1, 2),
                self.pos[layer][fr, row].transpose(1, 2))

    def positions(self, layer: int, req: torch.Tensor) -> torch.Tensor:
        fr, row = self._address(req)
        return self.pos[layer][fr, row].transpose(1, 2)

    def set_positions(self, layer: int, req: torch.Tensor, pos: torch.Tensor) -> None:
        """pos [B, H, K] of request slots req [B] (distinct slots)."""
        fr, row = self._address(req)
        self.pos[layer][fr, row] = pos.transpose(1, 2).to(POSITION_DTYPE)

    def flat_rows(self, layer: int, req: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k, v [F * C * H, D] views of `layer`, out_rows [B, H, K]): where row j of head h of request slot req[b]
        lies in them (the prefetch's destination)."""
        fr, row = self._address(req)
        H, D = self.k.shape[3], self.k.shape[4]
        heads = torch.arange(H, device=fr.device)
        out_rows = (fr * self.rows_per_frame + row)[:, None, :] * H + heads[None, :, None]
        return self.k[layer].view(-1, D), self.v[layer].view(-1, D), out_rows

    def reset(self, req_slots: list[int]) -> None:
        """Nothing prefetched for these request slots, in any layer."""
        slots = [r for r in req_slots if self._holds is None or self._holds(r)]
        if slots:
            frames = self.table[torch.tensor(slots, dtype=torch.int64, device=self.table.device)].reshape(-1)
            self.pos[:, frames] = -1

    def device_bytes(self) -> int:
        """Bytes allocated for the rows beyond the pool's pages (pooled: the table alone)."""
        own = (self.table,) if self.pooled else (self.k, self.v, self.pos, self.table)
        return sum(t.numel() * t.element_size() for t in own)

    def row_bytes(self) -> int:
        """Bytes of one prefetched row: its K and V."""
        return 2 * self.k.shape[-1] * self.k.element_size()
