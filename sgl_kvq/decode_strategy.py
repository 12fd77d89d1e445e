"""How a format's decode reads its KV: the interface that the sizing, the server-argument resolution and the pool
ask, instead of testing for SpeCache. A format names its strategy (Format.strategy); sgl_kvq/strategies.py maps the
name to the object, patches/backends.py to the attention backend classes that serve it.

The default strategy reads the pool alone (the packed pages and the fp16 frames): no host memory, no per-request
state beyond the frames, every SGLang feature the pool supports, decode under CUDA graphs on kvq_triton. SpeCache's
strategy (sgl_kvq/specache/strategy.py) adds a 16-bit host tier and a speculative decode lane.
"""

from __future__ import annotations

import torch


class DecodeStrategy:
    # Whether decode runs in SGLang's eager forward (patches/eager_decode.py hooks it and calls eager_decode_step),
    # never under CUDA graphs.
    eager_decode: bool = False

    def host_bytes_per_token(self, shape, model_dtype: torch.dtype) -> int:
        """Host RAM each pool token takes beside its device pages."""
        return 0

    def host_budget_bytes(self, cfg, host_is_device: bool) -> int | None:
        """The host RAM the strategy may take where it is not the device's memory (None: it takes none)."""
        return None

    def request_frames(self, cfg, shape, model_dtype: torch.dtype) -> int:
        """Pooled frames a running request takes beyond its ring for the strategy's per-request state, taken and
        given back with the ring (sgl_kvq/frames.py); 0: none, or that state cannot be pooled at this geometry."""
        return 0

    def request_bytes(self, cfg, shape, model_dtype: torch.dtype, *, frames_pooled: bool) -> int:
        """Device bytes each request slot owns for the server's life beyond its frames (frames_pooled: the
        server's frames are pooled, so are request_frames' worth of the state)."""
        return 0

    def refusal(self, feature: str, name: str) -> str | None:
        """Why `feature` ("hicache", "disaggregation", "sliding_window") cannot serve dtype `name` with this strategy,
        or None."""
        return None

    def state(self, cfg, shape, num_req_slots: int, model_dtype: torch.dtype, device, store=None):
        """The per-pool runtime state (KVQTokenToKVPool.strategy_state), or None; store: the pool's QuantizedKVStore,
        whose extra frames (store.frames.extra, request_frames of them) hold the per-request state."""
        return None

    def eager_decode_step(self, forward, forward_batch, state):
        """One decode step where eager_decode: forward() runs SGLang's model on forward_batch's rows and returns its
        LogitsProcessorOutput; the strategy returns what SGLang's sampler gets."""
        return forward()

    def device_bytes(self, state) -> int:
        """Device bytes of that state (counted half with K, half with V in the pool's byte split)."""
        return 0

    def host_bytes(self, state) -> int:
        """Host bytes of that state."""
        return 0

    def stats(self, state, capacity_tokens: int) -> dict:
        """The state's entries in the pool's stats."""
        return {}


POOL_ONLY = DecodeStrategy()
