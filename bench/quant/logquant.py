"""LogQuant: a log-distributed set of fp16 positions over a 2-bit KIVI base.

Selection rule (the official code's prefill rule, LogQuantKV `LogQuantizedCache.update`), for length T, window W:
    kept = [0, 1, ..., T-1]
    while len(kept) >= 3W:
        kept = kept[0:2W:2] + kept[2W:]      # the oldest 2W kept positions are thinned to every 2nd one
Each pass removes W positions, so the result is all T positions while T < 3W and 2W..3W-1 positions after; the
newest len(kept) - 2W >= W positions are never thinned (the most recent W are always kept); older positions have
been through more passes, each halving their density, so the gaps between kept positions never shrink going back in
time (roughly doubling per W kept: log-spaced; tests/unit/test_quant_logquant.py checks it); position 0 is never thinned
(kept[0] leads every slice), which keeps the attention sink in fp16.

Storage: the served logquant2 page format (sgl_kvq/formats/logquant/codec.py) applied to a sequence, as the pool holds
it at length T: every complete page outside KIVI's fp16 window (the open page + R/G complete pages) is a 2-bit KIVI
page plus the fp16 rows the rule keeps in it at the moment it left that window (T_exit(n) = (n + ring) * G + 1 for
page n); the window and the open page are fp16. The rule is monotone (a position dropped at T is never kept later),
so at every T the fp16 rows cover what log_positions(T, W) keeps outside the window, and may hold more (positions
dropped since the page's exit stay fp16: an exact copy is never worse to read).
Attention is permutation-invariant in the keys (LogQuant section 2.4): softmax(q K^T) V is unchanged when the rows
of K and V are permuted together, so the fp16 rows may sit anywhere next to the base (the test checks it).
"""

from __future__ import annotations

import torch

from sgl_kvq.formats.logquant import codec as logquant_page
from sgl_kvq.quant import kivi_page
from sgl_kvq.quant.compressed import CompressedKV, check_kv
from bench.quant.kivi import quantized_len


def log_positions(T: int, window: int) -> list[int]:
    kept = list(range(T))
    if window <= 0:
        return []
    while len(kept) >= 3 * window:
        kept = kept[0:2 * window:2] + kept[2 * window:]
    return kept


def logquant(k: torch.Tensor, v: torch.Tensor, *, bits: int = 2, window: int = 10, group_size: int = 64,
             value_group: int = 64, residual: int = 64, specache_one_bit: bool = True) -> CompressedKV:
    """The served logquant2's pages over a whole [T, H, D] sequence (defaults: sgl_kvq.config's)."""
    T, H, D = check_kv(k, v)
    G, ring = group_size, 1 + residual // group_size
    n_q = quantized_len(T, G, residual)
    n = n_q // G
    M = logquant_page.max_rows(window, G, ring)
    off = logquant_page.offsets_table(window, G, ring, n, M)
    kp, vp = k[:n_q].reshape(n, G, H, D), v[:n_q].reshape(n, G, H, D)
    pages = kivi_page.pack_pages(kp, vp, bits, min(value_group, D), specache_one_bit=specache_one_bit)
    k_rows, v_rows = logquant_page.gather_rows(kp, vp, off)
    rows = logquant_page.PageRows(k_rows, v_rows, off)
    k_q, v_q = logquant_page.apply_rows(*kivi_page.dequantize_pages(pages, bits), rows)
    stored = {"k.codes": pages.k_codes, "k.scale": pages.k_scale, "k.zero": pages.k_zero,
              "v.codes": pages.v_codes, "v.scale": pages.v_scale, "v.zero": pages.v_zero,
              "k.rows": k_rows, "v.rows": v_rows, "k.row_off": off,
              "k.fp16": k[n_q:].to(torch.float16), "v.fp16": v[n_q:].to(torch.float16)}
    kept = torch.zeros(T, H, dtype=torch.bool)
    kept[n_q:] = True
    pg, slot = (off != logquant_page.EMPTY).nonzero(as_tuple=True)
    kept[pg * G + off[pg, slot].long()] = True
    return CompressedKV(torch.cat([k_q.reshape(n_q, H, D), stored["k.fp16"].float()]),
                        torch.cat([v_q.reshape(n_q, H, D), stored["v.fp16"].float()]), stored, kept)
