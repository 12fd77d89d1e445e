"""LogQuant: a log-distributed set of fp16 positions over a 2-bit KIVI base.

Selection rule (the official code's prefill rule, LogQuantKV `LogQuantizedCache.update`), for length T, window W:
    kept = [0, 1, ..., T-1]
    while len(kept) >= 3W:
        kept = kept[0:2W:2] + kept[2W:]      # the oldest 2W kept positions are thinned to every 2nd one
Each pass removes W positions, so the result is all T positions while T < 3W and 2W..3W-1 positions after; the
newest len(kept) - 2W >= W positions are never thinned (the most recent W are always kept); older positions have
been through more passes, each halving their density, so the gaps between kept positions never shrink going back in
time (roughly doubling per W kept: log-spaced; tests/test_quant_logquant.py checks it); position 0 is never thinned
(kept[0] leads every slice), which keeps the attention sink in fp16.

Storage, page-shaped like the pool's base: every complete page is quantized 2-bit KIVI-style (selected positions
included, as the official code also quantizes them and overwrites them on read); the selected positions and the
open page are kept in fp16 and override the base; their int32 positions are stored (keys' account).
Attention is permutation-invariant in the keys (LogQuant section 2.4): softmax(q K^T) V is unchanged when the rows
of K and V are permuted together, so the fp16 overlay can sit in any order next to the base (the test checks it).
Default W = R / 3, so the fp16 budget (< 3W) matches KIVI's window R.
"""

from __future__ import annotations

import torch

from sgl_kvq.quant.compressed import CompressedKV, check_kv
from sgl_kvq.quant.kivi import quantize_span


def log_positions(T: int, window: int) -> list[int]:
    kept = list(range(T))
    if window <= 0:
        return []
    while len(kept) >= 3 * window:
        kept = kept[0:2 * window:2] + kept[2 * window:]
    return kept


def logquant(k: torch.Tensor, v: torch.Tensor, *, bits: int = 2, window: int = 21, group_size: int = 64,
             value_group: int = 64, specache_one_bit: bool = True) -> CompressedKV:
    T, H, D = check_kv(k, v)
    n_q = group_size * (T // group_size)  # complete pages; the open page stays fp16
    k_q, v_q, stored = quantize_span(k[:n_q], v[:n_q], bits, group_size, value_group,
                                     specache_one_bit=specache_one_bit)
    selected = set(log_positions(T, window)) | set(range(n_q, T))
    pos = torch.tensor(sorted(selected), dtype=torch.int64)
    stored["k.fp16"] = k[pos].to(torch.float16)
    stored["v.fp16"] = v[pos].to(torch.float16)
    stored["k.fp16_pos"] = pos.to(torch.int32)
    k_hat = torch.cat([k_q, torch.zeros(T - n_q, H, D)])
    v_hat = torch.cat([v_q, torch.zeros(T - n_q, H, D)])
    k_hat[pos] = stored["k.fp16"].float()
    v_hat[pos] = stored["v.fp16"].float()
    kept = torch.zeros(T, H, dtype=torch.bool)
    kept[pos] = True
    return CompressedKV(k_hat, v_hat, stored, kept)
