"""SGLang's KVCache interface over the quantized store (sgl_kvq/kv_store.py).

The pool owns every write: the kvq backends call the store's `begin_batch` / `write_layer` with the batch's request
slots and positions. The stock entry points that would hand out or accept plain bf16 rows raise, so no SGLang path
can write unquantized KV around the quantizer (a fused bf16 write into a get_key_buffer() view) or dequantize the
whole pool to serve a read.
"""

from __future__ import annotations

import collections

import logging

import torch
from sglang.srt.mem_cache.memory_pool import KVCache

from sgl_kvq.kv_store import QuantizedKVStore
from sgl_kvq.layout import counts_as_value
from sgl_kvq.pd_transfer import base_buf_infos, request_state_buf_infos
from sgl_kvq.pool_shape import PoolShape
from sgl_kvq.strategies import strategy_of

logger = logging.getLogger(__name__)


class KVQPoolError(RuntimeError):
    pass


def kv_cache_stats(pool: KVCache, capacity_tokens: int) -> dict:
    """The byte accounting every SGLang KV pool has (a bf16 one too): the keys a capacity comparison reads."""
    k, v = pool.get_kv_size_bytes() if hasattr(pool, "get_kv_size_bytes") else (0, 0)
    return {
        "pool_class": type(pool).__name__,
        "capacity_tokens": int(capacity_tokens),
        "kv_bytes": int(k + v),
        "kv_bytes_per_token": (k + v) / max(capacity_tokens, 1),
        "page_size": int(getattr(pool, "page_size", 1)),
    }


class KVQTokenToKVPool(KVCache):
    def __init__(self, size: int, shape: PoolShape, device: str, model_dtype: torch.dtype, num_req_slots: int,
                 start_layer: int | None = None, end_layer: int | None = None, enable_memory_saver: bool = False,
                 frames_pooled: bool = False):
        """size tokens of capacity; shape: the geometry derived once where SGLang sizes the pool
        (patches/sizing.py: kvq_pool_shape), with num_pages = ceil(size / G). frames_pooled: running requests'
        fp16 frames are carved from the pool's pages (sgl_kvq/frames.py; the allocator hands them out)."""
        cfg = shape.cfg
        pages = -(-size // shape.G)
        if shape.num_pages != pages:
            raise KVQPoolError(f"sgl_kvq: {size} tokens need {pages} pages, the shape has {shape.num_pages}")
        # dtype is the packed storage type, never bf16: SGLang enables fused bf16 writes into get_key_buffer()
        # views when pool.dtype == bfloat16 (sglang/srt/models/utils.py: enable_fused_set_kv_buffer).
        super().__init__(size, shape.G, torch.uint8, shape.layers, device, enable_memory_saver, start_layer,
                         end_layer)
        self.cfg = cfg
        self.head_num, self.head_dim, self.v_head_dim = shape.heads, shape.head_dim, shape.head_dim
        self.shape = shape
        self.strategy = strategy_of(cfg)
        # pooled: a running request's frames hold its decode strategy's state too (SpeCache's top-k rows)
        extra = self.strategy.request_frames(cfg, shape, model_dtype) if frames_pooled else 0
        self.store = QuantizedKVStore(cfg, self.shape, num_req_slots, model_dtype, device,
                                      frames_pooled=frames_pooled, extra_frames=extra)
        # Decode batches per kvq_torch decode path ("pages" / "padded"; sgl_kvq/backends/torch_backend.py), exported
        # with the stats: which path served a workload
        self.decode_batches: collections.Counter[str] = collections.Counter()
        # the decode strategy's per-pool state (SpeCache's host tier and top-k rows; None for the pool alone)
        self.strategy_state = self.strategy.state(cfg, self.shape, num_req_slots, model_dtype, self.store.device,
                                                  store=self.store)
        self._finalize_allocation_log(size)
        if frames_pooled:
            k, n = shape.pages_per_frame(model_dtype), self.store.frames.per_request
            logger.info("sgl_kvq %s pool: %d tokens, base %.1f B/token; each running request takes %d fp16 frames "
                        "of %d pages (%d tokens of the pool) while it runs", cfg.name, size,
                        self.shape.base_bytes_per_token(), n, k, n * k * shape.G)
        else:
            logger.info("sgl_kvq %s pool: %d tokens, base %.1f B/token, overlay %.1f MB (%d request slots x %d "
                        "frames)", cfg.name, size, self.shape.base_bytes_per_token(),
                        self.store.overlay_bytes() / 2**20, num_req_slots, cfg.ring_pages)

    # ---- what SGLang reads for sizing and logs ----
    def get_kv_size_bytes(self):
        """Device bytes of K and of V (SpeCache's host tier is not device memory: see host_bytes())."""
        s = self.store

        # pooled frames are the codes' own bytes; offsets and per-frame state count with the keys
        names = [*self.shape.base_names(), *([] if s.frames_pooled else ["ov_k", "ov_v"]), *s.frame_state]
        k = v = 0
        for n in names:
            t = getattr(s, n)
            if counts_as_value(n):
                v += t.numel() * t.element_size()
            else:
                k += t.numel() * t.element_size()
        state = self.strategy.device_bytes(self.strategy_state)
        return k + state // 2, v + state - state // 2

    def host_bytes(self) -> int:
        return self.strategy.host_bytes(self.strategy_state)

    def stats(self, capacity_tokens: int) -> dict:
        """The live pool's measured bytes (SGLang's /get_server_info internal_states[0]["kv_pool"]): kv_cache_stats
        plus the packed base and the overlay, the quantization config and, for SpeCache, the host tier and its
        counters."""
        stats = kv_cache_stats(self, capacity_tokens)
        stats.update(
            kv_cache_dtype=self.cfg.name,
            base_bytes=self.store.base_bytes(),
            overlay_bytes=self.store.overlay_bytes(),
            request_state_bytes=self.request_state_bytes(),
            frames_pooled=self.store.frames_pooled,
            frames_held=self.store.frames.frames_held(),
            # pool tokens one running request's pooled frames take (0: static frames, outside the pool)
            frame_tokens=self.store.frames.per_request * self.shape.pages_per_frame(self.store.model_dtype)
            * self.shape.G if self.store.frames_pooled else 0,
            base_bytes_per_token=self.shape.base_bytes_per_token(),
            layer_base_bytes_per_token=self.shape.layer_base_bytes_per_token(),
            pages_quantized=int(self.store.pages_quantized),
            config={"group_size": self.cfg.group_size, "value_group": self.shape.VG, "residual": self.cfg.residual,
                    "bits": self.cfg.bits, "prefill": self.cfg.prefill, "rotate": self.cfg.rotate,
                    **self.cfg.format.stats(self.cfg, self.shape.format_sizes()[1])},
        )
        if self.decode_batches:
            stats["decode_batches"] = dict(self.decode_batches)
        host = getattr(self, "hicache_host", None)  # HiCache's host tier (patches/hicache.py)
        if host is not None:
            stats.update(hicache_host_tokens=host.size, hicache_host_bytes=host.nbytes(), hicache_layout=host.layout)
        stats.update(self.strategy.stats(self.strategy_state, capacity_tokens))
        return stats

    def request_state_bytes(self) -> int:
        """The per-request fp16 state the pool allocated beyond its pages: static overlay frames (pooled ones are
        pages), and SpeCache's top-k buffers (pooled with the frames: their table alone)."""
        return self.store.overlay_bytes() + self.strategy.device_bytes(self.strategy_state)

    def get_v_head_dim(self):
        return self.v_head_dim

    def layer_index(self, layer_id: int) -> int:
        return layer_id - self.start_layer

    # ---- prefill/decode KV transfer (sgl_kvq/pd_transfer.py) ----
    def get_contiguous_buf_infos(self):
        """Every packed base buffer per layer, page-indexed: what SGLang's transfer backends register and send."""
        return base_buf_infos(self.store)

    def get_request_state_buf_infos(self):
        """The overlay frames (open page and fp16 window) per layer, indexed by request slot."""
        return request_state_buf_infos(self.store)

    # ---- stock accessors: refused, they would expose or accept unquantized rows ----
    def _refuse(self, what: str):
        raise KVQPoolError(f"sgl_kvq: {what} is not available on a {self.cfg.name} pool (packed codes); only the "
                           "kvq_torch / kvq_triton attention backends read and write it")

    def get_key_buffer(self, layer_id: int):
        self._refuse("get_key_buffer")

    def get_value_buffer(self, layer_id: int):
        self._refuse("get_value_buffer")

    def get_kv_buffer(self, layer_id: int):
        self._refuse("get_kv_buffer")

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, *args, **kwargs):
        self._refuse("set_kv_buffer")

    def move_kv_cache(self, tgt_loc, src_loc):
        self._refuse("move_kv_cache (speculative decoding)")

    def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
        self._refuse("get_cpu_copy (KV offload on retraction)")

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None, req_pool_index=None):
        self._refuse("load_cpu_copy (KV offload on retraction)")
