"""SpeCache's decode strategy (sgl_kvq/decode_strategy.py's interface): every pool token's 16-bit K/V in a host tier,
per running request the prefetched top-k rows (pool frames it takes with its overlay frames where those are pooled:
specache/topk_rows.py), and a two-lane decode in SGLang's eager forward (patches/eager_decode.py)."""

from __future__ import annotations

import logging

import torch

from sgl_kvq.decode_strategy import DecodeStrategy
from sgl_kvq.specache import host_tier, lanes, topk_rows
from sgl_kvq.specache import state as runtime

logger = logging.getLogger("sgl_kvq.pool")

_REFUSALS = {
    # HiCache's host pool holds the packed pages only, and evicting a page would leave its host rows behind.
    "hicache": "--enable-hierarchical-cache (HiCache) is not supported with {name} (it keeps its own host tier); "
               "use kivi/gear/logquant/zipcache dtypes with HiCache",
    # The 16-bit host tier is not described to SGLang's KV transfer: the decode side would get packed pages
    # without the host rows its top-k lane reads.
    "disaggregation": "prefill/decode disaggregation is not supported with {name} (its 16-bit host tier is not "
                      "sent); use a kivi/gear/logquant/zipcache dtype",
    # (sliding-window layers are served: its extend, both lanes and the top-k mask by the window)
}


class SpeCacheStrategy(DecodeStrategy):
    # the lanes hook SGLang's eager decode forward
    eager_decode = True

    def host_bytes_per_token(self, shape, model_dtype: torch.dtype) -> int:
        return host_tier.host_bytes_per_token(shape.layers, shape.heads, shape.head_dim, model_dtype)

    def host_budget_bytes(self, cfg, host_is_device: bool) -> int | None:
        if host_is_device:
            return None
        return int(host_tier.available_host_bytes() * cfg.params.host_mem_fraction)

    def request_frames(self, cfg, shape, model_dtype: torch.dtype) -> int:
        return topk_rows.pooled_frames(cfg.params.top_k, shape, model_dtype)

    def request_bytes(self, cfg, shape, model_dtype: torch.dtype, *, frames_pooled: bool) -> int:
        pooled = frames_pooled and self.request_frames(cfg, shape, model_dtype) > 0
        # pooled, what stays per slot is O(1) (its table row, speculative token and guess: 32 bytes at top-64):
        # bookkeeping beside SGLang's own req_to_token rows, outside the KV budget as those are
        return 0 if pooled else runtime.topk_bytes_per_request(cfg, shape, model_dtype, pooled=False)

    def refusal(self, feature: str, name: str) -> str | None:
        reason = _REFUSALS.get(feature)
        return None if reason is None else reason.format(name=name)

    def state(self, cfg, shape, num_req_slots: int, model_dtype: torch.dtype, device, store=None):
        state = runtime.SpeCacheState(cfg, shape, num_req_slots, model_dtype, device, store=store)
        where = (f"{store.frames.extra} pool frames per running request" if state.topk.pooled else
                 f"{state.device_bytes() / 2**20:.1f} MB for {num_req_slots} request slots")
        logger.info("sgl_kvq %s host tier: %.2f GiB (%d B/token), top-k rows: %s", cfg.name,
                    state.host.nbytes() / 2**30, state.host_bytes_per_token, where)
        return state

    def eager_decode_step(self, forward, forward_batch, state):
        return lanes.run_lanes(forward, forward_batch, state)

    def device_bytes(self, state) -> int:
        return state.device_bytes()

    def host_bytes(self, state) -> int:
        return state.host.nbytes()

    def stats(self, state, capacity_tokens: int) -> dict:
        host = self.host_bytes(state)
        return {"specache": state.stats(), "host_bytes": host, "host_bytes_per_token": host / max(capacity_tokens, 1)}


STRATEGY = SpeCacheStrategy()
