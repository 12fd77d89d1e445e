"""How a kvq pool splits SGLang's KV budget between packed tokens and per-request fp16 state.

A kvq pool costs `per_token` bytes for every token it can hold (the packed base) plus `per_request` bytes for every
request slot (the fp16 overlay frames of the open page and the window; SpeCache's top-k buffers too). SGLang gives
bf16 no per-request cost, so a fixed per-request charge at SGLang's usual request counts would eat a small budget:
257 slots x 2.95 MB of SmolLM2 frames is 758 MB, more than a 0.3 GiB budget holds.

The rule: per-request state takes at most `cfg.overlay_share` of the budget, and max_running_requests follows from
it (min. 1). An explicit --max-running-requests is honoured while the pool still holds at least bf16's tokens at the
same budget; beyond that it is refused with the largest value that fits. Mamba-style hybrid models in SGLang size
their per-request state the same way: a share of the budget, with the request count derived from it.

SpeCache's host tier holds every pool token in 16 bits. On a GPU it lives in host RAM, so the pool's tokens are
capped at what KVQ_HOST_MEM_FRACTION of the host's available RAM holds (the device memory beyond that stays free).
On the CPU engine host and "device" are one RAM: the host row is charged per token here (16-bit + packed > bf16:
SpeCache cannot hold more tokens than bf16 where host and device memory are one).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from sgl_kvq.config import KVQConfig, KVQConfigError
from sgl_kvq.layout import PoolShape


def dense_bytes_per_token(shape: PoolShape, model_dtype: torch.dtype) -> int:
    """What SGLang's own MHA pool stores per token in the model dtype (bf16's cell size)."""
    return 2 * shape.layers * shape.heads * shape.head_dim * torch.empty((), dtype=model_dtype).element_size()


def per_token_bytes(shape: PoolShape, model_dtype: torch.dtype, host_is_device: bool) -> int:
    """SGLang's cell size for a kvq pool: the packed base, plus SpeCache's host row where host RAM is the budget."""
    cell = math.ceil(shape.base_bytes_per_token())
    if shape.cfg.is_specache and host_is_device:
        from sgl_kvq.specache.host_tier import host_bytes_per_token

        cell += host_bytes_per_token(shape.layers, shape.heads, shape.head_dim, model_dtype)
    return cell


def per_request_bytes(shape: PoolShape, model_dtype: torch.dtype) -> int:
    """Bytes one request slot owns: its fp16 overlay frames, and SpeCache's top-k rows."""
    total = shape.cfg.ring_pages * shape.overlay_bytes_per_frame(model_dtype)
    if shape.cfg.is_specache:
        from sgl_kvq.specache.state import topk_bytes_per_request

        total += topk_bytes_per_request(shape.cfg, shape, model_dtype)
    return total


@dataclass(frozen=True)
class BudgetSplit:
    budget_bytes: int
    max_running_requests: int  # per worker; the pool has one more request slot (SGLang's ReqToTokenPool rows)
    per_request_bytes: int
    per_token_bytes: int
    dense_per_token_bytes: int  # the model dtype's bytes per token (SGLang's bf16 cell)
    page_size: int
    chosen_by: str  # "share" (derived from cfg.overlay_share) or "--max-running-requests"
    host_token_cap: int | None = None  # SpeCache on a GPU: the tokens whose 16-bit rows the host RAM allowed holds

    @property
    def request_slots(self) -> int:
        return self.max_running_requests + 1

    @property
    def request_bytes(self) -> int:
        return self.request_slots * self.per_request_bytes

    @property
    def tokens(self) -> int:
        """Tokens the pool holds (SGLang rounds down to whole pages)."""
        n = max(self.budget_bytes - self.request_bytes, 0) // self.per_token_bytes
        if self.host_token_cap is not None:
            n = min(n, self.host_token_cap)
        return n // self.page_size * self.page_size

    @property
    def dense_tokens(self) -> int:
        """Tokens a bf16 (model dtype) pool holds in the same budget."""
        return self.budget_bytes // self.dense_per_token_bytes

    @property
    def ratio(self) -> float:
        return self.tokens / max(self.dense_tokens, 1)

    def describe(self, name: str) -> str:
        return (f"sgl_kvq {name}: KV budget {self.budget_bytes / 2**30:.2f} GiB = {self.tokens} tokens x "
                f"{self.per_token_bytes} B + {self.request_slots} request slots x {self.per_request_bytes / 2**20:.2f} "
                f"MiB of fp16 state ({self.request_bytes / max(self.budget_bytes, 1):.1%} of the budget); "
                f"max_running_requests {self.max_running_requests} ({self.chosen_by}); "
                f"{self.ratio:.2f}x the {self.dense_tokens} tokens of the model dtype"
                + ("" if self.host_token_cap is None else f"; host tier caps the pool at {self.host_token_cap} tokens"))


def largest_fitting_requests(budget_bytes: int, per_request: int, per_token: int, dense_per_token: int,
                             share: float) -> int:
    """The most running requests whose state keeps the pool at >= the dense pool's tokens (and at least within
    `share` where even that is impossible, e.g. SpeCache on the CPU engine)."""
    allowed_share = max(share, 1 - per_token / dense_per_token)
    return int(allowed_share * budget_bytes) // per_request - 1


def split_budget(budget_bytes: int, shape: PoolShape, model_dtype: torch.dtype, *, host_is_device: bool,
                 requested: int | None = None, context_len: int | None = None,
                 host_budget_bytes: int | None = None) -> BudgetSplit:
    """Decide max_running_requests for a kvq pool of `shape` in `budget_bytes` (see the module doc).
    requested: the user's --max-running-requests per worker, or None. context_len: the model's, for SGLang's own
    cap on the default (2048..4096 requests, tokens // 2). host_budget_bytes: the host RAM SpeCache's host tier may
    take where it is not the device's memory."""
    cfg: KVQConfig = shape.cfg
    per_req = per_request_bytes(shape, model_dtype)
    per_tok = per_token_bytes(shape, model_dtype, host_is_device)
    dense = dense_bytes_per_token(shape, model_dtype)
    largest = largest_fitting_requests(budget_bytes, per_req, per_tok, dense, cfg.overlay_share)

    host_cap = None
    if cfg.is_specache and not host_is_device and host_budget_bytes is not None:
        from sgl_kvq.specache.host_tier import host_bytes_per_token

        # The host tier also holds page 0's rows (SGLang's dummy page).
        rows = host_budget_bytes // host_bytes_per_token(shape.layers, shape.heads, shape.head_dim, model_dtype)
        host_cap = max(rows // cfg.page_size - 1, 0) * cfg.page_size

    def split(n: int, how: str) -> BudgetSplit:
        return BudgetSplit(budget_bytes, n, per_req, per_tok, dense, cfg.page_size, how, host_cap)

    if requested is not None:
        if requested > largest:
            fix = (f"use --max-running-requests {largest} or less" if largest >= 1 else
                   f"raise the KV budget (--mem-fraction-static or KVQ_KV_CACHE_GB) above "
                   f"{_budget_for_one(per_req, per_tok, dense, cfg.overlay_share) / 2**30:.2f} GiB")
            raise KVQConfigError(
                f"sgl_kvq: --max-running-requests {requested} does not fit a {budget_bytes / 2**30:.2f} GiB KV budget "
                f"with {cfg.name}: each request slot holds {per_req / 2**20:.2f} MiB of fp16 state, and "
                f"{requested + 1} slots would leave fewer tokens than {dense_name(model_dtype)} holds in the same "
                f"budget; {fix}")
        return _capped(split(requested, "--max-running-requests"))
    by_share = int(cfg.overlay_share * budget_bytes) // per_req - 1
    n = by_share if by_share >= 1 else min(1, largest)
    if n < 1:
        raise KVQConfigError(
            f"sgl_kvq: a {budget_bytes / 2**30:.3f} GiB KV budget cannot hold one {cfg.name} request: two request "
            f"slots of fp16 state take {2 * per_req / 2**20:.1f} MiB; raise the KV budget (--mem-fraction-static or "
            f"KVQ_KV_CACHE_GB) above {_budget_for_one(per_req, per_tok, dense, cfg.overlay_share) / 2**30:.2f} GiB, "
            "or lower KVQ_RESIDUAL")
    s = split(n, f"{cfg.overlay_share:.0%} of the budget")
    if context_len:
        sglang_default = max(min(int(s.tokens / context_len * 512), 4096), 2048)
        s = split(min(n, sglang_default), s.chosen_by)
    return _capped(s)


def _capped(s: BudgetSplit) -> BudgetSplit:
    # SGLang never runs more requests than half the pool's tokens (kv_cache_configurator.resolve_max_num_reqs).
    cap = max(s.tokens // 2, 1)
    if s.max_running_requests <= cap:
        return s
    return dataclasses.replace(s, max_running_requests=cap)


def _budget_for_one(per_req: int, per_tok: int, dense: int, share: float) -> int:
    """The smallest budget at which one running request (two slots) fits the rule."""
    return int(2 * per_req / max(share, 1 - per_tok / dense)) + 1


def dense_name(model_dtype: torch.dtype) -> str:
    return str(model_dtype).replace("torch.", "")
