"""`sgl-kvq bench capacity`: KV token capacity of each dtype at the same KV memory, read from live servers.

Every server gets the same KV budget (KVQ_KV_CACHE_GB pins SGLang's budget for any dtype) and the same
--max-running-requests (the kvq overlay is a fixed cost per request slot; long-context serving needs few slots).
Capacity is what the server reports (max_total_num_tokens), bytes what its pool allocated."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2 | tiny | a model folder")
    p.add_argument("--kv-cache-dtype", default="auto,kivi4,kivi2,kivi1", help="comma list; auto = the model's bf16")
    p.add_argument("--kv-cache-gb", type=float, default=4.0)
    p.add_argument("--max-running-requests", type=int, default=32)
    p.add_argument("--json", metavar="PATH")


def measure(model, dtype: str, kv_cache_gb: float, max_running_requests: int, log_dir: str) -> dict:
    from sgl_kvq.launch import ServerProcess, baseline_page_size

    args = ["--model-path", str(model), "--max-running-requests", str(max_running_requests)]
    args += ["--page-size", str(baseline_page_size())] if dtype == "auto" else ["--kv-cache-dtype", dtype]
    os.environ["KVQ_KV_CACHE_GB"] = str(kv_cache_gb)
    with ServerProcess(args, log_path=Path(log_dir) / f"server-{dtype}.log") as server:
        stats = server.kv_pool_stats()
        # The pool must really hold what it claims: one request using most of a page round-trips.
        server.post("/generate", {"text": "capacity check", "sampling_params": {"max_new_tokens": 4}})
    return stats


def run(args) -> int:
    from sgl_kvq.commands import bench_multiturn

    model = bench_multiturn.resolve_model(args.model)
    log_dir = tempfile.mkdtemp(prefix="sgl-kvq-capacity-")
    dtypes = [d for d in args.kv_cache_dtype.split(",") if d]
    rows = {d: measure(model, d, args.kv_cache_gb, args.max_running_requests, log_dir) for d in dtypes}
    base = rows.get("auto")
    print(f"KV capacity at {args.kv_cache_gb} GiB of KV, --max-running-requests {args.max_running_requests} "
          f"({args.model}; server logs in {log_dir})")
    print(f"{'kv dtype':<10}{'capacity tok':>14}{'KV bytes':>16}{'B/token':>10}{'base B/tok':>12}{'overlay MiB':>13}"
          f"{'x bf16':>8}")
    for d, s in rows.items():
        ratio = s["capacity_tokens"] / base["capacity_tokens"] if base else float("nan")
        s["capacity_vs_bf16"] = ratio
        print(f"{d:<10}{s['capacity_tokens']:>14}{s['kv_bytes']:>16}{s['kv_bytes_per_token']:>10.0f}"
              f"{s.get('base_bytes_per_token', s['kv_bytes_per_token']):>12.0f}"
              f"{s.get('overlay_bytes', 0) / 2**20:>13.1f}{ratio:>8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "kv_cache_gb": args.kv_cache_gb,
                                               "max_running_requests": args.max_running_requests, "runs": rows},
                                              indent=2))
    return 0
