"""Pool sizing. SGLang sizes the KV pool as (budget - fixed overhead) / cell size and then picks
max_running_requests from the token count. For a kvq dtype the cell is the packed token, the fixed overhead is the
request slots' fp16 state, and max_running_requests comes from the split of the budget that sgl_kvq/capacity.py
decides once the budget is known (the rule and why: its docstring)."""

from __future__ import annotations

import logging

from sgl_kvq import env
from sgl_kvq.capacity import BudgetSplit, split_budget
from sgl_kvq.config import KVQConfigError, is_kvq_dtype, parse_kv_cache_dtype
from sgl_kvq.pool_shape import PoolShape
from sgl_kvq.strategies import strategy_of

logger = logging.getLogger("sgl_kvq")

# KVCacheConfigurator is a slots dataclass (no attribute can be added): its split is kept here, by identity.
_splits: dict[int, BudgetSplit] = {}
# The KV budget this process's pool was sized from (any dtype), exported with the pool's statistics.
_budget = {"bytes": None}


def profiled_budget_bytes() -> int | None:
    return _budget["bytes"]


def pool_shape(model_config, cfg, *, layers: int, attn_tp_size: int, attn_dcp_size: int = 1,
               num_pages: int = 0) -> PoolShape:
    """A kvq pool's geometry from SGLang's ModelConfig: the one place the KV heads of a rank and the head dim are
    read (before the model loads for a pinned budget's check, and where the pool is sized and built)."""
    heads = model_config.get_num_kv_heads(attn_tp_size, attn_dcp_size)
    return PoolShape(layers=layers, heads=heads, head_dim=model_config.head_dim, num_pages=num_pages, cfg=cfg)


def kvq_pool_shape(kvc, num_pages: int = 0) -> PoolShape | None:
    """The kvq pool's geometry from SGLang's KVCacheConfigurator (None for other dtypes)."""
    if not is_kvq_dtype(kvc.kv_cache_dtype_str):
        return None
    from sglang.srt.runtime_context import get_parallel

    return pool_shape(kvc.model_config, parse_kv_cache_dtype(kvc.kv_cache_dtype_str),
                      layers=kvc.layer_info.num_effective_layers, attn_tp_size=get_parallel().attn_tp_size,
                      attn_dcp_size=get_parallel().attn_dcp_size, num_pages=num_pages)


def budget_split(kvc) -> BudgetSplit:
    try:
        return _splits[id(kvc)]
    except KeyError:
        raise RuntimeError("sgl_kvq: the kvq pool was sized before its KV budget was profiled") from None


def requested_max_running_requests(kvc) -> int | None:
    """The user's --max-running-requests per data-parallel worker, as SGLang divides it."""
    from sglang.srt.runtime_context import get_schedule

    n = get_schedule().max_running_requests
    return None if n is None else max(1, n // kvc.attn_dp_size)


def profile_available_bytes(orig, self, *args, **kwargs):
    """KVQ_KV_CACHE_GB pins the KV budget (any dtype), so bf16 and kvq pools can be compared at equal memory. A
    kvq pool's split of the budget is decided here, where the budget is first known."""
    budget = env.kv_cache_budget_bytes()
    budget = _node_share(orig(self, *args, **kwargs), self.device) if budget is None else budget
    _budget["bytes"] = budget
    shape = kvq_pool_shape(self)
    if shape is not None:
        host_is_device = str(self.device).startswith("cpu")
        host_budget = strategy_of(shape.cfg).host_budget_bytes(shape.cfg, host_is_device)
        split = split_budget(budget, shape, self.model_dtype, host_is_device=host_is_device,
                             frames_pooled=frames_pooled(shape, self.model_dtype),
                             requested=requested_max_running_requests(self),
                             context_len=self.model_config.context_len, host_budget_bytes=host_budget)
        _splits[id(self)] = split
        logger.info("%s", split.describe(shape.cfg.name))
    return budget


def frames_pooled(shape, model_dtype) -> bool:
    """Whether this server's frames come out of the pool per running request (sgl_kvq/frames.py)."""
    from sglang.srt.runtime_context import get_disagg

    from sgl_kvq.frames import pooled_frames

    pooled = pooled_frames(shape, model_dtype, get_disagg().disaggregation_mode)
    if not pooled:
        logger.info("sgl_kvq: static fp16 frames per request slot (prefill/decode disaggregation, KVQ_FRAMES, "
                    "or a frame of more pages than the %d tokens of a page: frames.can_pool)", shape.G)
    return pooled


def _node_share(budget: int, device) -> int:
    """On the CPU engine SGLang sizes every rank's KV from its NUMA node's free RAM, as if the rank had the node to
    itself. Under the thread binding sgl_kvq chose for more ranks than nodes (cpu_engine.apply_threads_bind) the
    ranks on a node share it: each gets its share, so --mem-fraction-static keeps meaning a fraction of the
    machine's memory (at tp 2 on one node, each rank half). A binding the user set leaves SGLang's sizing alone."""
    import os

    from sgl_kvq.cpu_engine import RANKS_PER_NODE_ENV

    sharing = int(os.environ.get(RANKS_PER_NODE_ENV) or 1)
    if not str(device).startswith("cpu") or sharing <= 1:
        return budget
    logger.info("sgl_kvq: %d ranks share this NUMA node: KV budget %.3f GiB of the profiled %.3f GiB", sharing,
                budget / sharing / 2**30, budget / 2**30)
    return budget // sharing


def pool_configurator_init(orig, self, kvc, *args, **kwargs):
    orig(self, kvc, *args, **kwargs)
    if is_kvq_dtype(kvc.kv_cache_dtype_str):
        split = budget_split(kvc)
        self._cell_size = split.per_token_bytes
        self._fixed_overhead_bytes += split.request_bytes


def apply_token_constraints(orig, self, token_capacity: int) -> int:
    """SpeCache on a GPU: no more tokens than the host tier can hold (SGLang's own token cap, like
    --max-total-tokens). Pooled frames: the pool's pages are whole frames (sgl_kvq/layout.py)."""
    tokens = orig(self, token_capacity)
    split = _splits.get(id(self)) if is_kvq_dtype(self.kv_cache_dtype_str) else None
    if split is not None:
        if split.host_token_cap is not None:
            tokens = min(tokens, split.host_token_cap)
        tokens = split.round_tokens(tokens)
        if tokens < split.min_tokens:  # only a token cap (--max-total-tokens) gets here: the budget was checked
            raise KVQConfigError(
                f"sgl_kvq: {tokens} {self.kv_cache_dtype_str} tokens (--max-total-tokens) cannot hold one running "
                f"request's fp16 frames ({split.frame_tokens} tokens of pages) besides the padded rows' dummy frame; "
                f"use --max-total-tokens {split.min_tokens + split.page_size} or more")
    return tokens


def resolve_max_num_reqs(orig, self, token_capacity: int) -> int:
    """A kvq pool with per-slot state (SpeCache's top-k rows, static frames) runs what its split decided; with
    pooled frames alone SGLang's own default applies, and admission charges each request's frames."""
    if not is_kvq_dtype(self.kv_cache_dtype_str) or budget_split(self).max_running_requests is None:
        return orig(self, token_capacity)
    return min(budget_split(self).max_running_requests, max(token_capacity // 2, 1))
