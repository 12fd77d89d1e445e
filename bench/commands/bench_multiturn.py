"""`sgl-kvq bench multiturn`: one SGLang server per KV dtype (bf16 first, the baseline), all at the same KV memory
budget, each serving the same multi-turn ShareGPT workload; prints KV bytes per token and pool capacity from the live
pool, prefix-cache hits, greedy agreement with bf16 (later runs are sent bf16's assistant turns, so every run sees
identical prompts) and tokens/s. `sgl-kvq demo` is this with the main job's defaults."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2 | gemma3 | tiny | a model folder")
    p.add_argument("--kv-cache-dtype", default="kivi4,kivi2",
                   help="comma list of kv dtypes compared with bf16, e.g. kivi4,kivi3,kivi2")
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=3)
    p.add_argument("--kv-cache-gb", type=float, default=2.0,
                   help="KV budget of both servers (KVQ_KV_CACHE_GB), so capacities compare at equal memory")
    p.add_argument("--max-running-requests", type=int, default=None,
                   help="passed to both servers; by default each picks its own (a kvq dtype from its KV budget)")
    p.add_argument("--json", metavar="PATH", help="also write the measurements as JSON")


def resolve_model(name: str) -> Path:
    from bench.models import BUILDERS

    return BUILDERS[name]() if name in BUILDERS else Path(name)


def serve_and_run(model: Path, dtype: str, args, conversations, tokenizer, reference=None, log_dir=None):
    from bench.launch import ServerProcess, run_file
    from bench.workload import run_multiturn

    server_args = ["--model-path", str(model)]
    if args.max_running_requests is not None:
        server_args += ["--max-running-requests", str(args.max_running_requests)]
    if dtype != "auto":
        server_args += ["--kv-cache-dtype", dtype]
    else:
        from bench.launch import baseline_page_size

        server_args += ["--page-size", str(baseline_page_size())]
    os.environ["KVQ_KV_CACHE_GB"] = str(args.kv_cache_gb)
    log = run_file(log_dir, "server", dtype) if log_dir else None
    print(f"[multiturn] starting the server with --kv-cache-dtype {dtype} (log: {log})", flush=True)
    with ServerProcess(server_args, log_path=log) as server:
        stats = server.kv_pool_stats()
        print(f"[multiturn] {dtype}: {stats['capacity_tokens']} tokens of KV capacity; running the workload",
              flush=True)
        result = run_multiturn(server, tokenizer, conversations, args.max_new_tokens, args.concurrency, reference)
    return stats, result


def run(args) -> int:
    from transformers import AutoTokenizer

    from bench import data
    from bench.workload import agreement

    model = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    conversations = data.sharegpt_conversations(args.conversations, min_turns=args.turns, max_turns=args.turns)
    log_dir = tempfile.mkdtemp(prefix="sgl-kvq-demo-")
    rows = {}
    base_stats, base = serve_and_run(model, "auto", args, conversations, tokenizer, log_dir=log_dir)
    rows["bf16"] = (base_stats, base, {"token_agreement": 1.0, "exact_turns": 1.0})
    for dtype in [d for d in args.kv_cache_dtype.split(",") if d and d != "auto"]:
        stats, result = serve_and_run(model, dtype, args, conversations, tokenizer, reference=base, log_dir=log_dir)
        rows[dtype] = (stats, result, agreement(result, base))
    report = summarize(rows, base_stats, args)
    print_table(report, args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


def summarize(rows, base_stats, args) -> dict:
    out = {"model": args.model, "conversations": args.conversations, "turns": args.turns,
           "max_new_tokens": args.max_new_tokens, "kv_cache_gb": args.kv_cache_gb, "runs": {}}
    for name, (stats, result, agree) in rows.items():
        out["runs"][name] = {
            "kv_bytes_per_token": stats["kv_bytes_per_token"],
            "base_bytes_per_token": stats.get("base_bytes_per_token", stats["kv_bytes_per_token"]),
            "capacity_tokens": stats["capacity_tokens"],
            "capacity_vs_bf16": stats["capacity_tokens"] / base_stats["capacity_tokens"],
            "cached_tokens": sum(t.cached_tokens for t in result.turns),
            "cached_share_turns_2plus": result.cached_share_after_first_turn(),
            "token_agreement_with_bf16": agree["token_agreement"],
            "exact_turns_vs_bf16": agree["exact_turns"],
            "generated_tokens": result.generated_tokens,
            "tokens_per_s": result.generated_tokens / result.wall_s,
            "wall_s": result.wall_s,
        }
    return out


def print_table(report: dict, args) -> None:
    cols = [("KV B/token", "kv_bytes_per_token", "{:.0f}"), ("base B/token", "base_bytes_per_token", "{:.0f}"),
            ("capacity tok", "capacity_tokens", "{:d}"), ("x bf16", "capacity_vs_bf16", "{:.2f}"),
            ("cached tok", "cached_tokens", "{:d}"), ("cached % t2+", "cached_share_turns_2plus", "{:.0%}"),
            ("agree bf16", "token_agreement_with_bf16", "{:.1%}"), ("exact turns", "exact_turns_vs_bf16", "{:.0%}"),
            ("tok/s", "tokens_per_s", "{:.1f}")]
    print(f"\nsgl-kvq multiturn: {report['model']}, {report['conversations']} ShareGPT conversations "
          f"x {report['turns']} turns, {report['max_new_tokens']} new tokens/turn, "
          f"KV budget {report['kv_cache_gb']} GiB each")
    print(f"{'kv dtype':<10}" + "".join(f"{c[0]:>14}" for c in cols))
    for name, r in report["runs"].items():
        print(f"{name:<10}" + "".join(f"{c[2].format(r[c[1]]):>14}" for c in cols))
    print("KV B/token = allocated KV bytes (base + fp16 overlay) / capacity; base B/token = packed pages only.")
