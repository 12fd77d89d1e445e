"""How a kvq pool splits SGLang's KV budget between packed tokens and per-request fp16 state.

A kvq pool costs `per_token` bytes for every token it can hold (the packed base), and every running request keeps
its open page and R/G window pages in fp16 frames (sgl_kvq/frames.py).

Pooled frames (KVQ_FRAMES=pooled, the default): a frame is k of the pool's own pages (k =
pages_per_frame: 8 at 2 bit in bf16), handed to a request when SGLang gives it a request slot and taken back when the
slot is freed; SGLang's admission charges
them like tokens (the allocator's request_slot_reserve, patches/frames.py). So nothing is set aside per request
slot: an idle server holds budget / per_token tokens, a running request costs ring * k pages of them while it runs,
and max_running_requests is SGLang's own default (memory limits concurrency the way it limits bf16's). The pool's
page count is rounded down to whole frames, and frame 0's pages are the padded rows' dummy frame.

SpeCache's per-request top-k rows are pooled frames too (its strategy's request_frames: ceil(top-k / G) more
frames per running request, sgl_kvq/specache/topk_rows.py), charged with the ring.

Per-slot state that does stay fixed: the frames themselves under prefill/decode disaggregation (static
frames: SGLang sends a slot's frames as one row of its per-request state, so they sit at fixed places), with
SpeCache's top-k rows per slot beside them. For those the rule is: per-slot state takes at most
`cfg.overlay_share` of the budget, and max_running_requests follows from it (min. 1); an explicit
--max-running-requests is honoured while the pool still holds at least bf16's tokens at the same budget, and beyond
that refused with the largest value that fits.
Mamba-style hybrid models in SGLang size their per-request state the same way.

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
from sgl_kvq.frames import pooled_frames
from sgl_kvq.pool_shape import PoolShape
from sgl_kvq.strategies import strategy_of


def dense_bytes_per_token(shape: PoolShape, model_dtype: torch.dtype) -> int:
    """What SGLang's own MHA pool stores per token in the model dtype (bf16's cell size)."""
    return 2 * shape.layers * shape.heads * shape.head_dim * torch.empty((), dtype=model_dtype).element_size()


def per_token_bytes(shape: PoolShape, model_dtype: torch.dtype, host_is_device: bool, *,
                    frames_pooled: bool) -> int:
    """SGLang's cell size for a kvq pool: the packed base, plus SpeCache's host row where host RAM is the budget,
    plus (pooled frames) each token's share of the per-frame tags (and zipcache2's saliency accumulator)."""
    cell = math.ceil(shape.base_bytes_per_token())
    if host_is_device:
        cell += strategy_of(shape.cfg).host_bytes_per_token(shape, model_dtype)
    if frames_pooled:
        frame_extra = shape.overlay_bytes_per_frame(model_dtype) - 2 * _frame_kv_bytes(shape, model_dtype)
        cell += math.ceil(frame_extra / (shape.pages_per_frame(model_dtype) * shape.G))
    return cell


def config_pools(shape: PoolShape, model_dtype: torch.dtype) -> bool:
    """Whether a server without prefill/decode disaggregation pools this config's frames (KVQ_FRAMES)."""
    return pooled_frames(shape, model_dtype, "null")


def _frame_kv_bytes(shape: PoolShape, model_dtype: torch.dtype) -> int:
    return shape.layers * shape.G * shape.heads * shape.head_dim * torch.empty((), dtype=model_dtype).element_size()


def frames_per_request(shape: PoolShape, model_dtype: torch.dtype) -> int:
    """Pooled frames one running request takes: its ring, and its decode strategy's state (SpeCache's top-k rows)."""
    return shape.cfg.ring_pages + strategy_of(shape.cfg).request_frames(shape.cfg, shape, model_dtype)


def frame_tokens(shape: PoolShape, model_dtype: torch.dtype) -> int:
    """Pool tokens one running request's pooled frames take: frames_per_request frames of k pages."""
    return frames_per_request(shape, model_dtype) * shape.pages_per_frame(model_dtype) * shape.G


def per_request_bytes(shape: PoolShape, model_dtype: torch.dtype, *, frames_pooled: bool) -> int:
    """Bytes one request slot owns for the server's life: its fp16 overlay frames where they are static, and
    SpeCache's top-k rows where they are not pooled."""
    total = 0 if frames_pooled else shape.cfg.ring_pages * shape.overlay_bytes_per_frame(model_dtype)
    return total + strategy_of(shape.cfg).request_bytes(shape.cfg, shape, model_dtype, frames_pooled=frames_pooled)


@dataclass(frozen=True)
class BudgetSplit:
    budget_bytes: int
    # per worker; the pool has one more request slot (SGLang's ReqToTokenPool rows). None: SGLang's own default
    # (pooled frames and no other per-slot state: memory limits concurrency through admission).
    max_running_requests: int | None
    per_request_bytes: int  # fixed bytes per request slot (static frames, SpeCache's top-k rows)
    per_token_bytes: int
    dense_per_token_bytes: int  # the model dtype's bytes per token (SGLang's bf16 cell)
    page_size: int
    chosen_by: str  # "SGLang's default", the overlay share, or "--max-running-requests"
    host_token_cap: int | None = None  # SpeCache on a GPU: the tokens whose 16-bit rows the host RAM allowed holds
    pages_per_frame: int = 0  # pooled frames: pages one frame takes (the pool is whole frames); 0: static frames
    frame_tokens: int = 0  # pooled frames: pool tokens one running request's frames take

    @property
    def frames_pooled(self) -> bool:
        return self.pages_per_frame > 0

    @property
    def min_tokens(self) -> int:
        """The fewest tokens a pooled pool serves one request with: the dummy frame's pages, one request's frames
        and one page of its tokens (0 for static frames)."""
        if not self.frames_pooled:
            return 0
        return self.frame_tokens + (2 * self.pages_per_frame - 1) * self.page_size

    @property
    def request_slots(self) -> int:
        return 0 if self.max_running_requests is None else self.max_running_requests + 1

    @property
    def request_bytes(self) -> int:
        return self.request_slots * self.per_request_bytes

    @property
    def tokens(self) -> int:
        """Tokens the pool holds (SGLang rounds down to whole pages; pooled frames: to whole frames)."""
        n = max(self.budget_bytes - self.request_bytes, 0) // self.per_token_bytes
        if self.host_token_cap is not None:
            n = min(n, self.host_token_cap)
        return self.round_tokens(n)

    def round_tokens(self, n: int) -> int:
        """The most whole-page tokens up to n; pooled frames: such that the pool's pages, page 0 included, are
        whole frames."""
        pages = n // self.page_size
        if self.frames_pooled:
            pages = max((pages + 1) // self.pages_per_frame * self.pages_per_frame - 1, 0)
        return pages * self.page_size

    @property
    def dense_tokens(self) -> int:
        """Tokens a bf16 (model dtype) pool holds in the same budget."""
        return self.budget_bytes // self.dense_per_token_bytes

    @property
    def ratio(self) -> float:
        return self.tokens / max(self.dense_tokens, 1)

    def describe(self, name: str) -> str:
        slots = (f" + {self.request_slots} request slots x {self.per_request_bytes / 2**20:.2f} MiB of fixed state "
                 f"({self.request_bytes / max(self.budget_bytes, 1):.1%} of the budget)") if self.request_bytes else ""
        frames = (f"; each running request's fp16 frames take {self.frame_tokens} of the pool's tokens while it runs"
                  if self.frames_pooled else "; static fp16 frames per request slot")
        running = self.chosen_by if self.max_running_requests is None else \
            f"{self.max_running_requests} ({self.chosen_by})"
        return (f"sgl_kvq {name}: KV budget {self.budget_bytes / 2**30:.2f} GiB = {self.tokens} tokens x "
                f"{self.per_token_bytes} B{slots}{frames}; max_running_requests {running}; "
                f"{self.ratio:.2f}x the {self.dense_tokens} tokens of the model dtype"
                + ("" if self.host_token_cap is None else f"; host tier caps the pool at {self.host_token_cap} tokens"))


def largest_fitting_requests(budget_bytes: int, per_request: int, per_token: int, dense_per_token: int,
                             share: float, rounding_bytes: int = 0) -> int:
    """The most running requests whose state keeps the pool at >= the dense pool's tokens (and at least within
    `share` where even that is impossible, e.g. SpeCache on the CPU engine). rounding_bytes: what rounding the pool
    down (to whole frames) may cost besides."""
    allowed = max(share * budget_bytes, (1 - per_token / dense_per_token) * budget_bytes - rounding_bytes)
    return int(allowed) // per_request - 1


def split_budget(budget_bytes: int, shape: PoolShape, model_dtype: torch.dtype, *, host_is_device: bool,
                 frames_pooled: bool | None = None, requested: int | None = None, context_len: int | None = None,
                 host_budget_bytes: int | None = None) -> BudgetSplit:
    """Decide max_running_requests for a kvq pool of `shape` in `budget_bytes` (see the module doc).
    frames_pooled: frames carved from the pool per running request (else static per slot: prefill/decode
    disaggregation); None: as a plain server of this config (KVQ_FRAMES). requested: the user's
    --max-running-requests per worker, or None. context_len: the model's,
    for SGLang's own cap on the default (2048..4096 requests, tokens // 2). host_budget_bytes: the host RAM
    SpeCache's host tier may take where it is not the device's memory."""
    cfg: KVQConfig = shape.cfg
    if frames_pooled is None:
        frames_pooled = config_pools(shape, model_dtype)
    per_req = per_request_bytes(shape, model_dtype, frames_pooled=frames_pooled)
    per_tok = per_token_bytes(shape, model_dtype, host_is_device, frames_pooled=frames_pooled)
    dense = dense_bytes_per_token(shape, model_dtype)
    k = shape.pages_per_frame(model_dtype) if frames_pooled else 0
    frame_toks = frame_tokens(shape, model_dtype) if frames_pooled else 0

    host_cap = None
    host_per_token = strategy_of(cfg).host_bytes_per_token(shape, model_dtype)
    if host_per_token and not host_is_device and host_budget_bytes is not None:
        # The host tier also holds page 0's rows (SGLang's dummy page).
        rows = host_budget_bytes // host_per_token
        host_cap = max(rows // cfg.page_size - 1, 0) * cfg.page_size

    def split(n: int | None, how: str) -> BudgetSplit:
        return BudgetSplit(budget_bytes, n, per_req, per_tok, dense, cfg.page_size, how, host_cap, k, frame_toks)

    def frames_fit(s: BudgetSplit) -> BudgetSplit:
        need_tokens = s.min_tokens
        if s.tokens < need_tokens:
            raise KVQConfigError(
                f"sgl_kvq: a {budget_bytes / 2**30:.3f} GiB KV budget holds {s.tokens} {cfg.name} tokens, fewer than "
                f"one running request's fp16 frames need ({frame_toks} tokens) besides the padded rows' dummy frame; "
                f"raise the KV budget (--mem-fraction-static or KVQ_KV_CACHE_GB) above "
                f"{(need_tokens * per_tok + s.request_bytes + 1) / 2**30:.3f} GiB, or lower KVQ_RESIDUAL")
        return s

    if per_req == 0:
        s = frames_fit(split(requested, "SGLang's default" if requested is None else "--max-running-requests"))
        return s if requested is None else _capped(s)
    # pooled frames round the pool down to whole frames: leave room for that rounding
    largest = largest_fitting_requests(budget_bytes, per_req, per_tok, dense, cfg.overlay_share,
                                       rounding_bytes=k * cfg.page_size * per_tok)
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
        return frames_fit(_capped(split(requested, "--max-running-requests")))
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
    return frames_fit(_capped(s))


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
