"""SpeCache's decode lanes in one kernel launch per layer (jitted code: specache_decode_kernel.py).

    p = plan(paged, n_lanes=2, num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=G)     # per batch
    out, lse = specache_decode(q, k_own, v_own, kv, p, topk, sm_scale, scores=s)               # per layer
    pos = select_topk(s, lse_spec, base_tokens, num_kv_heads, top_k)  # per layer: head_mass (Triton) + torch.topk
    # follow=True: s holds both lanes' scores [2n, Hq, T]; select_topk(s[n:], lse[n:], ..., follow=(s[:n], lse[:n]))
# a sliding layer (window W >= 0): specache_decode(..., window=W), select_topk(..., first=window_first(p, W))

Rows of q [n_lanes * n, Hq, D] are lane-major; with two lanes rows [0, n) are the real tokens (the output lane) and
rows [n, 2n) their speculative tokens; with one lane (the pre-decode) every row is speculative. Both lanes read the
same keys (the paper's Algorithm 3, sgl_kvq/specache/attention.py is the reference): request b's packed base and
fp16 frames, with each position in its prefetched top-k set read from its 16-bit row instead of the codes (row j
of request slot r = topk.req[b], KV head h: topk.k/v[f, j % C, h] at position topk.pos[f, j % C, h], f =
topk.table[r, j // C]; -1 = none, positions >= the base tokens ignored: sgl_kvq/specache/topk_rows.py); the
speculative lane also reads its own k_own/v_own [n, H, D], which are never stored. No context is
dequantized to memory: codes are read once per page for both lanes. A top-k set must not repeat a position (the
torch.topk that selects it cannot).

The speculative lane's scores over the packed base land in `scores` [n, Hq, T >= the longest base] fp32 (log2
units): every position below a request's base tokens is written (by the base pass, or by the 16-bit split for a
prefetched one), nothing past it (not even a fill: at batch 64, 32 query heads and 32k tokens that is 268 MB per
layer); select_topk masks by base length, turning them and the merged lse into the next top-k positions on the
device, with fixed shapes and no host sync. With follow=True (two lanes) the output lane's scores are stored too,
lane-major in scores [2n, Hq, T], and select_topk adds their mass one position later (KVQ_SPECACHE_FOLLOW).

A sliding-window layer (window W >= 0, sgl_kvq/attention_ref.py): the output lane's row (at its context's last
position T - 1) sees T - 1 - W .. T - 1, the speculative lane's (its own key at T) T - W .. T, the prefetched rows
included; scores are written inside each row's window only, and select_topk, given the speculative rows' first
visible positions (window_first), chooses among them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton

from sgl_kvq.plan import LayerKV, PagedPlan

from .arg_groups import page_lists, pool_args, split_parts
from .checks import MODEL_DTYPES, check_layer, check_paged, dot_in_fp32, layer_geometry, require
from .decode_attention import _MIN_TOKENS_PER_SPLIT, LOG2E, default_max_splits
from .format_extras import format_extras
from .merge_state import merge_state
from .specache_decode_kernel import _specache_decode_kernel
from .specache_mass_kernel import _head_mass_kernel


@dataclass
class SpeCachePlan:
    paged: PagedPlan
    n_lanes: int  # 2: output + speculative rows per request; 1: speculative rows only (pre-decode)
    num_splits: torch.Tensor  # [n] int32 base/frame splits of request b (the 16-bit split is one more)
    merge_splits: torch.Tensor  # [n_lanes * n] int32: num_splits + 1 for each row
    max_splits: int
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    o_partial: torch.Tensor  # [n_lanes * n, Hq, max_splits + 1, D] fp32
    lse_partial: torch.Tensor  # [n_lanes * n, Hq, max_splits + 1] fp32
    base_tokens: torch.Tensor  # [n] int64 tokens in request b's packed base
    context_tokens: torch.Tensor  # [n] int64 tokens in request b's context (base and frames)

    @property
    def batch_size(self) -> int:
        return self.num_splits.numel()


@dataclass
class TopK:
    """One layer's prefetched rows (sgl_kvq/specache/topk_rows.py): k, v [F, C, H, D] model dtype in frames of C
    rows, pos [F, C, H] int64 (-1: none), table [R, m] each request slot's frames (row j in frame table[r, j // C]),
    req [n] the request slot of each batch request, top_k the rows per request and head (None: all m * C)."""
    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    table: torch.Tensor
    req: torch.Tensor
    top_k: int | None = None

    @classmethod
    def per_slot(cls, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, req: torch.Tensor) -> TopK:
        """Rows by request slot, k, v [R, H, K, D] and pos [R, H, K], as one frame of K rows per slot."""
        table = torch.arange(k.shape[0], device=k.device)[:, None]
        return cls(k.transpose(1, 2), v.transpose(1, 2), pos.transpose(1, 2).contiguous(), table, req, k.shape[2])


class TopKArgs(NamedTuple):
    """The kernel's argument group of TopK: k, v, pos, table, req and the strides it indexes them by."""
    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    table: torch.Tensor
    req: torch.Tensor
    stride_tf: int
    stride_tc: int
    stride_th: int
    stride_pf: int
    stride_pc: int
    stride_ph: int
    stride_table: int


def plan(paged: PagedPlan, *, n_lanes: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
         max_splits: int | None = None, min_pages_per_split: int | None = None) -> SpeCachePlan:
    dev = paged.kv_indptr.device
    check_paged(paged, dev)
    require(n_lanes in (1, 2), f"n_lanes must be 1 or 2, got {n_lanes}")
    require(num_qo_heads % num_kv_heads == 0, f"{num_qo_heads} query heads over {num_kv_heads} KV heads")
    B = paged.batch_size
    if max_splits is None:
        max_splits = default_max_splits(dev, B, num_kv_heads)  # one program serves both lanes: B x H programs
    if min_pages_per_split is None:
        min_pages_per_split = max(1, _MIN_TOKENS_PER_SPLIT // page_size)
    require(max_splits >= 1 and min_pages_per_split >= 1, "max_splits and min_pages_per_split must be >= 1")
    n_base = paged.kv_indptr.diff()
    n_pages = n_base + paged.ov_indptr.diff()
    num_splits = ((n_pages + min_pages_per_split - 1) // min_pages_per_split).clamp(1, max_splits).to(torch.int32)
    base_tokens = torch.where(n_base > 0, (n_base - 1) * page_size + paged.kv_last_page_len, 0).long()
    n_frames = paged.ov_indptr.diff()
    context_tokens = base_tokens + torch.where(n_frames > 0, (n_frames - 1) * page_size + paged.ov_last_page_len, 0)
    S = max_splits + 1
    return SpeCachePlan(
        paged=paged, n_lanes=n_lanes, num_splits=num_splits, merge_splits=(num_splits + 1).repeat(n_lanes),
        max_splits=max_splits, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        page_size=page_size,
        o_partial=torch.empty(n_lanes * B, num_qo_heads, S, head_dim, dtype=torch.float32, device=dev),
        lse_partial=torch.empty(n_lanes * B, num_qo_heads, S, dtype=torch.float32, device=dev),
        base_tokens=base_tokens, context_tokens=context_tokens,
    )


def window_first(p: SpeCachePlan, window: int) -> torch.Tensor | None:
    """[n] int64: the first context position each request's speculative row sees under a sliding `window` (its own
    key at position context_tokens), where select_topk's candidates start; None without a window."""
    return None if window < 0 else (p.context_tokens - window).clamp(min=0)


def specache_decode(q: torch.Tensor, k_own: torch.Tensor, v_own: torch.Tensor, kv: LayerKV, p: SpeCachePlan,
                    topk: TopK | None, sm_scale: float, scores: torch.Tensor,
                    out: torch.Tensor | None = None, follow: bool = False,
                    window: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out [n_lanes * n, Hq, D] in q's dtype, lse [n_lanes * n, Hq] fp32 natural log); writes `scores` below
    each request's base tokens (within each row's window): the speculative rows' [n, Hq, T], or with follow both
    lanes' [2n, Hq, T]. topk None: no prefetched rows (the pre-decode reads the context as stored). window: a
    sliding layer's W, -1 for none."""
    H, D, G, VG = check_layer(kv)
    extras, extras_consts = format_extras(kv, layer_geometry(kv))
    # the kernel applies extras as decode does, but no format with extras serves SpeCache: its reference
    # (sgl_kvq/specache/attention.py) reads plain KIVI pages
    require(kv.extras is None, "SpeCache pages are plain KIVI pages")
    n, L = p.batch_size, p.n_lanes
    require(q.dim() == 3 and tuple(q.shape) == (L * n, p.num_qo_heads, D),
            f"q must be [{L} x {n}, Hq={p.num_qo_heads}, D={D}], got {tuple(q.shape)}")
    require(q.dtype in MODEL_DTYPES and q.stride(-1) == 1, f"q must be a contiguous-last-dim model dtype, {q.dtype}")
    require((H, D, G) == (p.num_kv_heads, p.head_dim, p.page_size),
            f"plan was made for (H, D, G) = {(p.num_kv_heads, p.head_dim, p.page_size)}, pool has {(H, D, G)}")
    for name, t in (("k_own", k_own), ("v_own", v_own)):
        require(tuple(t.shape) == (n, H, D) and t.stride(-1) == 1, f"{name} must be [{n}, {H}, {D}], got "
                f"{tuple(t.shape)}")
    require(not follow or L == 2, "follow needs the output lane (n_lanes=2)")
    scored = L * n if follow else n
    require(scores.dim() == 3 and scores.shape[:2] == (scored, p.num_qo_heads) and scores.dtype == torch.float32
            and scores.stride(-1) == 1, f"scores must be [{scored}, {p.num_qo_heads}, T] fp32")
    require(q.device == kv.ov_k.device == p.num_splits.device == scores.device,
            "q, the pool, the plan and the scores are on different devices")
    if topk is None:
        K, C = 1, 1
        topk_args = TopKArgs(kv.ov_k, kv.ov_v, p.base_tokens, p.base_tokens, p.base_tokens,
                             *[0] * 7)  # never read
    else:
        F, C, Ht, Dt = topk.k.shape
        K = topk.table.shape[1] * C if topk.top_k is None else topk.top_k
        require((Ht, Dt) == (H, D) and topk.v.shape == topk.k.shape and topk.v.stride() == topk.k.stride(),
                f"top-k rows must be [F, C, {H}, {D}], got {tuple(topk.k.shape)}")
        require(tuple(topk.pos.shape) == (F, C, H) and topk.pos.dtype == torch.int64, "top-k pos must be [F, C, H]")
        require(topk.table.dim() == 2 and topk.table.dtype == torch.int64 and 0 < K <= topk.table.shape[1] * C,
                f"the top-k table must be [R, m >= {K} / {C}] int64")
        require(topk.k.stride(-1) == 1 and topk.pos.stride(-1) == 1 and topk.table.stride(-1) == 1,
                "top-k buffers need a contiguous last dim")
        require(tuple(topk.req.shape) == (n,), f"top-k req must be [{n}]")
        topk_args = TopKArgs(topk.k, topk.v, topk.pos, topk.table, topk.req, topk.k.stride(0), topk.k.stride(1),
                             topk.k.stride(2), topk.pos.stride(0), topk.pos.stride(1), topk.pos.stride(2),
                             topk.table.stride(0))
    require(scores.shape[2] >= 1, "scores need at least one position")
    if out is None:
        out = torch.empty_like(q)
    lse = torch.empty(L * n, p.num_qo_heads, dtype=torch.float32, device=q.device)
    group = p.num_qo_heads // H
    if n:
        _specache_decode_kernel[(n, H, p.max_splits + 1)](
            q, pool_args(kv), extras, k_own, v_own, topk_args, page_lists(p.paged), p.num_splits,
            split_parts(p.o_partial, p.lse_partial), scores, sm_scale * LOG2E, n, H,
            q.stride(0), q.stride(1), k_own.stride(0), k_own.stride(1), v_own.stride(0), v_own.stride(1),
            scores.stride(0), scores.stride(1), window,
            GROUP=group, BLOCK_M=max(16, triton.next_power_of_2(L * group)), D=D, G=G, BITS=(kv.k_bits, kv.v_bits),
            VG=VG,
            K=K, BLOCK_K=max(16, triton.next_power_of_2(K + 1)), BLOCK_P=triton.next_power_of_2(K), NLANES=L,
            SPEC_LANE=L - 1, USE_TOPK=topk is not None, FOLLOW=follow, MAX_SPLITS=p.max_splits, TOPK_ROWS=C,
            DOT_FP32=dot_in_fp32(q.dtype), **extras_consts,
        )
    merge_state(p.o_partial, p.lse_partial, p.merge_splits, out=out, lse_out=lse)
    return out, lse


def head_mass_ref(scores: torch.Tensor, lse: torch.Tensor, base_tokens: torch.Tensor,
                  num_kv_heads: int, follow: tuple[torch.Tensor, torch.Tensor] | None = None,
                  first: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of head_mass."""
    n, Hq, T = scores.shape
    t = torch.arange(T, device=scores.device)[None, None, :]
    in_base = t < base_tokens[:, None, None]
    if first is not None:
        in_base = in_base & (t >= first[:, None, None])

    def mass(s, l, where):
        p = torch.exp2(torch.where(where.expand(n, Hq, T), s, float("-inf")) - (l * LOG2E)[:, :, None])
        return p.view(n, num_kv_heads, Hq // num_kv_heads, T).sum(2)

    out = mass(scores, lse, in_base)
    if follow is not None:  # the output rows' mass at t - 1 for every candidate t (t - 1 may precede the window)
        read = torch.zeros_like(in_base)
        read[..., :-1] = in_base[..., 1:]
        out[..., 1:] += mass(*follow, read)[..., :-1]
    return torch.where(in_base, out, -1.0)


def head_mass(scores: torch.Tensor, lse: torch.Tensor, base_tokens: torch.Tensor, num_kv_heads: int,
              out: torch.Tensor | None = None,
              follow: tuple[torch.Tensor, torch.Tensor] | None = None,
              first: torch.Tensor | None = None) -> torch.Tensor:
    """scores [n, Hq, T] (specache_decode's, log2 units), lse [n, Hq] (the speculative rows' merged lse), base_tokens
    [n] -> [n, H, T] fp32: each base position's attention probability summed over the KV head's query heads; -1 at
    positions past a request's base (never read there: the decode kernel leaves them unwritten). follow: the output
    rows' (scores, lse), same shapes and strides: their mass at position t - 1 is added at t. first [n] (a sliding
    window, window_first): positions before it are not read either and get -1."""
    n, Hq, T = scores.shape
    require(Hq % num_kv_heads == 0 and scores.dtype == torch.float32 and scores.stride(-1) == 1,
            "scores must be [n, Hq, T] fp32 with Hq a multiple of the KV heads")
    require(tuple(lse.shape) == (n, Hq) and lse.dtype == torch.float32 and lse.stride(-1) == 1,
            f"lse must be [{n}, {Hq}] fp32")
    require(tuple(base_tokens.shape) == (n,), f"base_tokens must be [{n}]")
    require(first is None or tuple(first.shape) == (n,), f"first must be [{n}]")
    fs, flse = (scores, lse) if follow is None else follow  # never read without FOLLOW
    require(fs.shape == scores.shape and fs.stride() == scores.stride() and flse.shape == lse.shape
            and flse.stride() == lse.stride(), "follow's scores and lse must match the speculative ones' shapes")
    if out is None:
        out = torch.empty(n, num_kv_heads, T, dtype=torch.float32, device=scores.device)
    require(tuple(out.shape) == (n, num_kv_heads, T) and out.stride(-1) == 1, "out must be [n, H, T]")
    group = Hq // num_kv_heads
    block_t = 256
    if n and T:
        _head_mass_kernel[(n, num_kv_heads, triton.cdiv(T, block_t))](
            scores, lse, fs, flse, base_tokens, base_tokens if first is None else first, out, T, scores.stride(0),
            scores.stride(1), lse.stride(0), out.stride(0), out.stride(1), GROUP=group,
            BLOCK_G=triton.next_power_of_2(group), BLOCK_T=block_t, FOLLOW=follow is not None, WINDOW=first is not None)
    return out


def select_topk(scores: torch.Tensor, lse: torch.Tensor, base_tokens: torch.Tensor, num_kv_heads: int,
                top_k: int, follow: tuple[torch.Tensor, torch.Tensor] | None = None,
                first: torch.Tensor | None = None) -> torch.Tensor:
    """scores [n, Hq, T], lse [n, Hq] as head_mass takes them -> [n, H, top_k] int64: per KV head the base positions
    with the most attention mass summed over its query heads, -1 padded past each request's base tokens
    (sgl_kvq/specache/attention.py top_positions). first [n] (window_first): only positions from it on are chosen.
    Device ops only."""
    n, _, T = scores.shape
    # -1 past the base (and before the window): base positions are picked first
    mass = head_mass(scores, lse, base_tokens, num_kv_heads, follow=follow, first=first)
    k = min(top_k, T)
    idx = mass.topk(k, dim=-1).indices
    chosen = idx < base_tokens[:, None, None]
    if first is not None:
        chosen &= idx >= first[:, None, None]
    pos = torch.where(chosen, idx, -1)
    if k < top_k:
        pos = torch.cat([pos, pos.new_full((n, num_kv_heads, top_k - k), -1)], dim=-1)
    return pos
