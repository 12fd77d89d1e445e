"""LogQuant on one page of G tokens: the exact format of a logquant2 base page (see sgl_kvq/layout.py).

A logquant2 page is KIVI's 2-bit page plus up to M fp16 row slots: the page's positions that LogQuant's rule
(`logquant.log_positions`, window W) keeps at the moment the page leaves the request's fp16 window, i.e. at context
length T_exit(n) = (n + ring) * G + 1 for logical page n (ring = KVQConfig.ring_pages: metadata/host.plan_contexts
reads page n from the base once (query_pos // G) - ring >= n). Row slot j holds offset row_off[j] of the page (255:
empty; G <= 128 so it never matches) and that token's K and V in fp16; a reader dequantizes the page and replaces
the stored rows, in registers in the kernels (kernels/paged_kv_kernel.py), never in memory.

Why at exit and kept for as long as the page is read: the offsets are a function of n alone (positions, not
contents), so every request that shares the page through the radix tree reads the same rows whatever batch wrote it,
and a radix hit reads what the rule keeps. The rule is monotone (a position dropped at T is never kept at T' > T,
tests/unit/test_quant_logquant_page.py), so the rows at exit hold every position of the page the rule keeps later; the
ones it drops later stay fp16 (an exact copy is never worse to read, and a per-query selection would make the extend
kernel's key tile depend on the query).

What the rule adds beyond KIVI's window (open page + R/G complete pages in fp16): position 0 (the sink) and the
band of recent positions it keeps (about 6W back, density halving going back) where that band reaches past the
window. M, the most rows one page needs, is measured by simulating the rule (`max_rows`): W=21, G=R=64 -> 8;
W <= 12, G=R=64 -> 1 (only the sink: the band fits the window).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from sgl_kvq.formats.page_codec import PageCodec, PageWrite
from sgl_kvq.quant import kivi_page
from sgl_kvq.quant.uniform import SCALE_DTYPE

EMPTY = 255  # row_off of an unused slot (uint8); G <= 128, so no offset equals it
# Simulated context length for M and the periodic part of the offsets table: the rule's pattern relative to T is
# periodic after its first pages (period W / gcd(W, G) pages, measured for W <= 64), reached well inside it.
HORIZON_TOKENS = 1 << 16


class PageRows(NamedTuple):
    """One layer's stored rows: per pool page P (or selected pages N), M slots."""
    k_rows: torch.Tensor  # [P, M, H, D] fp16: key of the token at offset row_off[p, j]
    v_rows: torch.Tensor  # [P, M, H, D] fp16
    row_off: torch.Tensor  # [P, M] uint8: in-page offset of slot j, EMPTY if unused


class RuleState:
    """LogQuant's rule grown one position at a time: after append(T - 1), `kept` == log_positions(T, W).
    Thinning when the list reaches 3W is the from-scratch rule's loop run at every length, O(W) per step."""

    def __init__(self, window: int):
        self.window, self.kept, self.T = window, [], 0

    def append(self) -> None:
        self.kept.append(self.T)
        self.T += 1
        W = self.window
        if len(self.kept) >= 3 * W:
            self.kept = self.kept[0:2 * W:2] + self.kept[2 * W:]


def exit_length(n: int, G: int, ring: int) -> int:
    """The context length at which logical page n is first read from the base (plan_contexts)."""
    return (n + ring) * G + 1


def simulate_rows(window: int, G: int, ring: int, n_pages: int) -> list[list[int]]:
    """Offsets of logical pages 0 .. n_pages - 1 that the rule keeps at each page's exit length."""
    s, out = RuleState(window), []
    while len(out) < n_pages:
        s.append()
        while len(out) < n_pages and s.T == exit_length(len(out), G, ring):
            lo = len(out) * G
            out.append([p - lo for p in s.kept if lo <= p < lo + G])
    return out


@functools.lru_cache(maxsize=None)
def _horizon_rows(window: int, G: int, ring: int, horizon: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(r) for r in simulate_rows(window, G, ring, max(1, horizon // G)))


def max_rows(window: int, G: int, ring: int, horizon: int = HORIZON_TOKENS) -> int:
    """M: the most rows the rule keeps in one page at its exit, over the pages of the first `horizon` tokens."""
    return max(len(r) for r in _horizon_rows(window, G, ring, horizon))


def _period(rows: tuple, start: int) -> int:
    """The smallest p with rows[n] == rows[n + p] for every simulated n >= start (checked over at least 2p pages)."""
    n = len(rows)
    for p in range(1, (n - start) // 3 + 1):
        if all(rows[i] == rows[i + p] for i in range(start, n - p)):
            return p
    raise ValueError(f"sgl_kvq: LogQuant's rows show no period within {n} pages; raise HORIZON_TOKENS")


def offsets_table(window: int, G: int, ring: int, n_pages: int, M: int,
                  device: str | torch.device = "cpu") -> torch.Tensor:
    """[n_pages, M] uint8: row slot offsets of logical pages 0 .. n_pages - 1 (EMPTY-padded). Pages past the
    simulated horizon repeat its periodic part (tests check it against a direct simulation)."""
    rows = _horizon_rows(window, G, ring, HORIZON_TOKENS)
    start = 2  # the sink's page and the first pages are not periodic (page 0 holds position 0)
    p = _period(rows, start)
    n = torch.arange(n_pages)
    src = torch.where(n < len(rows), n, start + (n - start) % p)
    table = torch.full((len(rows), M), EMPTY, dtype=torch.uint8)
    for i, r in enumerate(rows):
        if len(r) > M:
            raise ValueError(f"sgl_kvq: page {i} keeps {len(r)} rows, more than M={M}")
        table[i, :len(r)] = torch.tensor(r, dtype=torch.uint8)
    return table[src].to(device)


def gather_rows(k: torch.Tensor, v: torch.Tensor, off: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [N, G, H, D] complete pages, off [N, M] uint8 -> their rows (k_rows, v_rows) [N, M, H, D] fp16, zero in
    empty slots (static shapes, no host sync: the CUDA-graph decode write calls it)."""
    G = k.shape[1]
    idx = off.long().clamp(max=G - 1)
    used = (off != EMPTY)[..., None, None]
    n = torch.arange(k.shape[0], device=k.device)[:, None]
    return (torch.where(used, k[n, idx].to(SCALE_DTYPE), 0).to(SCALE_DTYPE),
            torch.where(used, v[n, idx].to(SCALE_DTYPE), 0).to(SCALE_DTYPE))


def select_pages(pool: PageRows, pages: torch.Tensor) -> PageRows:
    return PageRows(*(t[pages] for t in pool))


def apply_rows(k_hat: torch.Tensor, v_hat: torch.Tensor, r: PageRows) -> tuple[torch.Tensor, torch.Tensor]:
    """k_hat, v_hat [N, G, H, D] fp32 (the pages' dequantized base) -> with the stored rows in place of theirs."""
    pg, slot = (r.row_off != EMPTY).nonzero(as_tuple=True)
    t = r.row_off[pg, slot].long()
    k_hat[pg, t] = r.k_rows[pg, slot].float()
    v_hat[pg, t] = r.v_rows[pg, slot].float()
    return k_hat, v_hat


def rows_per_page(cfg) -> int:
    """M: the most rows one page keeps at its exit from the fp16 window."""
    return max_rows(cfg.params.window, cfg.group_size, cfg.ring_pages)


def rows_of(lpages: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, tables: dict) -> PageRows:
    """The rows LogQuant's rule keeps of pages k, v [N, G, H, D] at logical page indices lpages [N]."""
    if lpages is None:
        raise ValueError("sgl_kvq: logquant2 pages need their logical page indices (lpages) to pick their rows")
    off = tables["row_table"][lpages.long()]
    return PageRows(*gather_rows(k, v, off), off)


class LogQuantCodec(PageCodec):
    plain_pages = False

    def tables(self, cfg, g, device: torch.device) -> dict[str, torch.Tensor]:
        # the row offsets per logical page: a request's logical pages never outnumber the pool's pages
        return {"row_table": offsets_table(cfg.params.window, cfg.group_size, cfg.ring_pages, g.P,
                                           rows_per_page(cfg), device)}

    def pack(self, cfg, value_group: int, k, v, w: PageWrite, tables: dict):
        base = kivi_page.pack_pages(k, v, cfg.bits, value_group, specache_one_bit=cfg.specache_one_bit)
        return base, rows_of(w.lpages, k, v, tables)

    def correct(self, k, v, extras, pages):
        return apply_rows(k, v, select_pages(extras, pages))

    def correct_padded(self, k, v, r: PageRows, ctx) -> None:
        """The stored rows written over their positions, base pages only (apply_rows' rule)."""
        off = r.row_off[ctx.pages]  # [B, U, M]
        b, u, j = ((off != EMPTY) & ctx.is_base_page[..., None]).nonzero(as_tuple=True)
        t = off[b, u, j].long()
        pg = ctx.pages[b, u]
        k[:, b, u, t] = r.k_rows[pg, j].float().transpose(0, 1)  # [H, n, D]
        v[:, b, u, t] = r.v_rows[pg, j].float().transpose(0, 1)
