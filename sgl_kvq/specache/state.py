"""SpeCache's runtime state on one quantized pool: the host tier, the prefetched top-k rows, the speculative tokens
and the counters the scheduler exports.

Per running request, the rows the next step's output row reads in 16 bits, per layer and KV head, and their
positions in its context (topk: sgl_kvq/specache/topk_rows.py; with pooled frames they are pool pages the request
takes with its frames). Per request slot r (SGLang's req_pool_idx), device tensors:
    spec_token      [R]             int64         r's next speculative token (row 1's input next step)
    spec_input      [R]             int64         row 1's input of r's last step (-1: none): the guess of the
                                                  token row 0 reads next, counted as a hit when it was right
and on the host needs_predecode [R]: set by every extend of r (a new request, a resumed one, the next chunk),
cleared by the pre-decode step that makes r's first speculative token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sgl_kvq.config import KVQConfig
from sgl_kvq.pool_shape import PoolShape
from sgl_kvq.specache.host_tier import HostTier, check_host_budget, host_bytes_per_token
from sgl_kvq.specache.topk_rows import TopKRows


@dataclass
class Lanes:
    """What the rows of the next decode forward are: set by run_lanes (specache/lanes.py), read by the backend.
    two_lane: rows [0, n_real) are the real tokens of the batch's requests, rows [n_real, 2 n_real) their
    speculative tokens. predecode: row i is the real token of batch row rows[i], read-only (no KV written)."""
    kind: str
    n_real: int
    rows: torch.Tensor | None = None


def topk_bytes_per_request(cfg: KVQConfig, shape: PoolShape, model_dtype: torch.dtype, *, pooled: bool) -> int:
    """Device bytes one request slot owns for the server's life: its speculative token and guess, its row of the
    top-k table, and (static top-k rows) the rows and positions themselves."""
    L, H, D, K = shape.layers, shape.heads, shape.head_dim, cfg.params.top_k
    rows = 0 if pooled else L * H * K * (2 * D * torch.empty((), dtype=model_dtype).element_size() + 8)
    table = 8 * (-(-K // shape.G) if pooled else 1)
    return rows + table + 16


class SpeCacheState:
    def __init__(self, cfg: KVQConfig, shape: PoolShape, num_req_slots: int, model_dtype: torch.dtype,
                 device: torch.device, store=None):
        """store: the pool's QuantizedKVStore, whose request slots take pool frames for their top-k rows where it
        carries extra frames (store.frames.extra); else the rows are a region per request slot."""
        L, H, D, K, R = shape.layers, shape.heads, shape.head_dim, cfg.params.top_k, num_req_slots
        self.cfg, self.top_k, self.heads = cfg, K, H
        self.device = torch.device(device)
        per_token = host_bytes_per_token(L, H, D, model_dtype)
        check_host_budget(cfg.name, shape.S, per_token, cfg.params.host_mem_fraction)
        self.host = HostTier(L, shape.S, H, D, model_dtype, self.device)
        self.host_bytes_per_token = per_token
        if store is not None and store.frames.extra:
            self.topk = TopKRows.over_pool_frames(store, K)
        else:
            self.topk = TopKRows.static(L, R, H, D, K, model_dtype, self.device)
        self.spec_token = torch.zeros(R, dtype=torch.int64, device=self.device)
        self.spec_input = torch.full((R,), -1, dtype=torch.int64, device=self.device)
        self.needs_predecode = [True] * R
        self.lanes: Lanes | None = None
        self.recall = bool(cfg.params.recall)
        # counters (device tensors where the value is on the device: no sync until someone reads them)
        self.decode_steps = 0
        self.predecode_rows = 0
        self.prefetched_rows = torch.zeros((), dtype=torch.int64, device=self.device)
        self.spec_hits = torch.zeros((), dtype=torch.int64, device=self.device)
        self.spec_guesses = torch.zeros((), dtype=torch.int64, device=self.device)
        self.recall_hits = 0
        self.recall_wanted = 0

    def device_bytes(self) -> int:
        own = sum(t.numel() * t.element_size() for t in (self.spec_token, self.spec_input))
        return own + self.topk.device_bytes()

    def reset_requests(self, req_slots: list[int]) -> None:
        """An extend ran for these slots: their next decode step pre-decodes; nothing prefetched is theirs."""
        for r in req_slots:
            self.needs_predecode[r] = True
        self.topk.reset(req_slots)
        self.spec_input[torch.tensor(req_slots, dtype=torch.int64, device=self.device)] = -1

    def fence(self) -> None:
        """Before a forward: with pooled top-k rows, a prefetch of the last step may still be copying into the frames
        of a request slot freed since, whose pages the allocator may now hand out as tokens; this forward's writes
        wait for it."""
        if self.topk.pooled:
            self.host.fence()

    def count_guesses(self, req: torch.Tensor, real_ids: torch.Tensor) -> None:
        """Row 0's inputs this step against row 1's inputs of the same requests last step."""
        last = self.spec_input[req]
        seen = last >= 0
        self.spec_guesses += seen.sum()
        self.spec_hits += (seen & (last == real_ids)).sum()

    def prefetch(self, layer: int, req: torch.Tensor, pos: torch.Tensor, req_to_token: torch.Tensor) -> None:
        """Fetch the 16-bit rows of positions pos [B, H, K] (-1: none) of requests in slots req [B] from the host
        tier into layer `layer`'s top-k buffers, for the next step's output rows."""
        B, H, K = pos.shape
        req = req.long()
        valid = pos >= 0
        slots = torch.where(valid, req_to_token[req[:, None, None], pos.clamp(min=0)].long(), -1)
        heads = torch.arange(H, device=pos.device)[None, :, None].expand(B, H, K)
        self.topk.set_positions(layer, req, pos)
        out_k, out_v, out_rows = self.topk.flat_rows(layer, req)
        self.host.prefetch(layer, slots.reshape(-1), heads.reshape(-1), out_k, out_v, out_rows.reshape(-1))
        self.prefetched_rows += valid.sum()

    def stats(self) -> dict:
        row_bytes = self.topk.row_bytes()
        rows = int(self.prefetched_rows)
        guesses, hits = int(self.spec_guesses), int(self.spec_hits)
        return {
            "top_k": self.top_k,
            "host_bytes": self.host.nbytes(),
            "host_bytes_per_token": self.host_bytes_per_token,
            "topk_device_bytes": self.device_bytes(),
            "topk_pooled": self.topk.pooled,
            "decode_steps": self.decode_steps,
            "predecode_rows": self.predecode_rows,
            "prefetched_rows": rows,
            "prefetched_bytes": rows * row_bytes,
            "prefetched_bytes_per_step": rows * row_bytes / max(self.decode_steps, 1),
            "copy_seconds": self.host.copy_seconds,
            "spec_token_hit_rate": hits / guesses if guesses else None,
            "spec_token_guesses": guesses,
            "spec_token_hits": hits,
            "recall": self.recall_hits / self.recall_wanted if self.recall_wanted else None,
            "recall_wanted": self.recall_wanted,
        }
