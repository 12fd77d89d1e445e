"""What a question after a long document costs one sliding-window layer of kvq_torch's extend: reading only the pages
its window reaches (sgl_kvq/attention_extend.py) against dequantizing every page of the prefix and masking all but
the window (what it did before: git show d950e16:sgl_kvq/attention_extend.py), and one full-attention layer beside
them. docs/long-context.md ("What makes long contexts run on the CPU engine") quotes it.

    python bench/extend_window.py --json bench/results/extend-window-gemma3.json

One layer of Gemma 3 270M's geometry (1 KV head, 4 query heads, head_dim 256, window 512) holding a kivi prefix of
C tokens, written as the server writes it; the extend's new tokens are a question's (40). Thread CPU time on one
thread (time.thread_time: what the call costs, whatever else the machine runs), the median of --reps, the ways
alternating in one process; both sliding ways give the same output (checked).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.decode_work import filled_store  # noqa: E402
from sgl_kvq import attention_extend  # noqa: E402
from sgl_kvq.attention_extend import _sdpa  # noqa: E402
from sgl_kvq.attention_ref import gather_context, visible_from, window_mask  # noqa: E402
from sgl_kvq.metadata.forward import read_plan  # noqa: E402

HQ, H, D, WINDOW = 4, 1, 256, 512


def every_page(q, k, v, kv, plan, p: int):
    """The prefix dequantized whole, then the window cut out of it."""
    kp, vp = gather_context(kv, plan, 0)
    first = int(visible_from(p, WINDOW))
    mask = window_mask(q.shape[0], p, WINDOW, q.device)[:, first:]
    return _sdpa(q, torch.cat([kp[first:], k]), torch.cat([vp[first:], v]), mask, D ** -0.5)


def measure(context: int, bits: int, new: int, reps: int) -> dict:
    store, req_to_token, reqs = filled_store(1, context, bits, geometry=(1, H, D))
    plan = read_plan(store, req_to_token, reqs, torch.tensor([context]))
    kv = store.layer_view(0)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(new, h, D, generator=gen) for h in (HQ, H, H))
    qo = torch.tensor([0, new])
    ways = {
        "sliding, every page read": lambda: every_page(q, k, v, kv, plan, context),
        "sliding, the window's pages read": lambda: attention_extend.extend(q, k, v, qo, kv, plan, D ** -0.5,
                                                                            window=WINDOW),
        "full attention": lambda: attention_extend.extend(q, k, v, qo, kv, plan, D ** -0.5),
    }
    ref, out = ways["sliding, every page read"](), ways["sliding, the window's pages read"]()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    times = {name: [] for name in ways}
    for _ in range(reps):
        for name, fn in ways.items():
            t = time.thread_time()
            fn()
            times[name].append(time.thread_time() - t)
    ms = {name: round(statistics.median(ts) * 1e3, 2) for name, ts in times.items()}
    return {"context": context, "bits": bits, "new_tokens": new, "ms": ms,
            "sliding_speedup": round(ms["sliding, every page read"] / ms["sliding, the window's pages read"], 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, nargs="+", default=[8192, 16384, 32704])
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--new", type=int, default=40, help="new tokens of the extend (a question's)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = [measure(c, args.bits, args.new, args.reps) for c in args.context]
    finally:
        torch.set_num_threads(threads)
    for r in rows:
        print(r["context"], r["ms"], f"{r['sliding_speedup']}x")
    if args.json:
        args.json.write_text(json.dumps({"bench": "extend_window", "command": "python bench/extend_window.py "
                                         + " ".join(argv if argv is not None else sys.argv[1:]),
                                         "threads": 1, "window": WINDOW, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
