"""`sgl-kvq bench soak`: bench/soak.py's load against one server per dtype and mode, for a fixed time, at a KV
budget that forces eviction and retraction. Per run: requests served by kind, server errors (5xx, exceptions in
the server log, the server dying), retractions and evicted tokens (SGLang's own counters, --enable-metrics), the
replay agreement, the pool's live counts after /flush_cache against their startup values, and the resident memory
curve of the server processes (JSON + PNG).

Modes: "deterministic" (KVQ_PREFILL=paged, KVQ_RESIDUAL=0: a page's codes are a function of its tokens alone, so
every completed turn must replay identically) and "default" (its agreement is reported, not required).
"""

from __future__ import annotations

import json
import os
import random
import shlex
import time
from pathlib import Path

from bench.soak import MAX_CONVERSATION, NEW_TOKENS

MODES = {"deterministic": {"KVQ_PREFILL": "paged", "KVQ_RESIDUAL": "0"}, "default": {}}

# 2,048 tokens (32 pages) hold three of the clients' longest conversations (640 + 72 + 48 tokens): six clients
# overflow it, so the tree evicts. Decode does not retract at these defaults: with ignore_eos SGLang's admission
# reserves every token a request may still write. --stop-at-eos with long outputs retracts (docs/soak.md).
MAX_TOTAL_TOKENS = 2048
CLIENTS = 6
# Resident memory may grow this much after warm-up (allocator caches settle; a leak of a page's fp16 rows per
# request would pass it within minutes).
RSS_GROWTH_MIB = 64


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2 | gemma3 | tiny | a model folder")
    p.add_argument("--dtypes", default="kivi2,specache2", help="comma list of kv cache dtypes (auto = bf16)")
    p.add_argument("--modes", default="deterministic,default", help=f"comma list of {', '.join(MODES)}")
    p.add_argument("--seconds", type=float, default=180, help="load time per run")
    p.add_argument("--clients", type=int, default=CLIENTS, help="concurrent conversations")
    p.add_argument("--max-total-tokens", type=int, default=MAX_TOTAL_TOKENS, help="the KV budget in tokens")
    p.add_argument("--new-tokens", default=f"{NEW_TOKENS[0]},{NEW_TOKENS[1]}", metavar="LO,HI",
                   help="each turn's output length, drawn from this range (ignore_eos): longer outputs outgrow "
                        "what admission reserved for them, so decode retracts on its own")
    p.add_argument("--max-conversation", type=int, default=MAX_CONVERSATION, metavar="TOKENS",
                   help="a conversation starts over once longer than this: short conversations with long outputs "
                        "let many requests run at once and outgrow the budget together")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="turns, streams and aborts stop at the model's EOS (no ignore_eos): SGLang's admission then "
                        "reserves only new_token_ratio of max_new_tokens for them, as for real chats, and decode "
                        "retracts when they outgrow it (with ignore_eos it reserves every token: no retraction)")
    p.add_argument("--server-args", default="", metavar="'ARGS'",
                   help="more launch_server flags for every server, e.g. '--schedule-conservativeness 0.3' (admission "
                        "reserves less for the outputs to come, so the pool fills and decode retracts)")
    p.add_argument("--replay-max", type=int, default=0, help="replay at most this many completed turns, evenly "
                   "spaced (0: all)")
    p.add_argument("--test-retract", action="store_true", help="also SGLANG_TEST_RETRACT=1 (SGLang retracts "
                   "every third decode step): retraction in a short run, whatever the machine's speed")
    p.add_argument("--json", metavar="PATH", help="write the runs here (after every run)")
    p.add_argument("--append", action="store_true", help="add the runs to those already in --json")
    p.add_argument("--png", metavar="PATH", help="plot the resident memory curves here")
    p.add_argument("--logs", metavar="DIR", default=None, help="server logs (default: a temporary folder)")


def soak_one(model, dtype: str, mode: str, seconds: float, clients: int, max_total_tokens: int, log_path: Path,
             replay_max: int = 0, test_retract: bool = False, new_tokens: tuple[int, int] = NEW_TOKENS,
             max_conversation: int = MAX_CONVERSATION, server_args: tuple[str, ...] = (),
             stop_at_eos: bool = False) -> dict:
    """One server, one soak, every check's numbers (no assertion: the caller judges)."""
    from transformers import AutoConfig

    from bench import soak
    from sgl_kvq.config import is_kvq_dtype
    from bench.launch import ServerProcess, baseline_page_size

    cfg = AutoConfig.from_pretrained(str(model))
    args = ["--model-path", str(model), "--max-total-tokens", str(max_total_tokens), "--enable-metrics"]
    args += ["--kv-cache-dtype", dtype] if is_kvq_dtype(dtype) else ["--page-size", str(baseline_page_size())]
    args += list(server_args)
    env = {**MODES[mode], **({"SGLANG_TEST_RETRACT": "1"} if test_retract else {})}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with ServerProcess(args, log_path=log_path) as server:
            warm = soak.generate(server.base, soak.draw(random.Random(1), cfg.vocab_size, 80), 8)
            warm.raise_for_status()
            idle = soak.flush_when_idle(server)
            rss_start = soak.rss_bytes(server.proc.pid)
            t0 = time.time()
            tally, curve, by_role = soak.run_load(server, cfg.vocab_size, cfg.max_position_embeddings, clients,
                                                  seconds, max_total_tokens, new_tokens=new_tokens,
                                                  max_conversation=max_conversation, ignore_eos=not stop_at_eos)
            load_s = time.time() - t0
            counters = soak.metrics(server.base)
            end = soak.flush_when_idle(server)
            turns = tally.turns
            if replay_max and len(turns) > replay_max:
                turns = [turns[i * len(turns) // replay_max] for i in range(replay_max)]
            t1 = time.time()
            replayed = soak.replay(server.base, turns)
            replayed["seconds"] = round(time.time() - t1, 1)
            alive = server.proc.poll() is None
            capacity = server.kv_pool_stats()["capacity_tokens"]
            log = log_path.read_text(errors="replace")  # before shutdown's lines
            log_errors, kv_full = soak.server_log_errors(log), soak.kv_full_retractions(log)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return {
        "dtype": dtype, "mode": mode, "env": env, "clients": clients, "new_tokens": list(new_tokens),
        "max_conversation": max_conversation, "server_args": list(server_args), "stop_at_eos": stop_at_eos,
        "load_seconds": round(load_s, 1),
        "capacity_tokens": capacity, "counts": tally.counts, **counters,
        "retracted_because_full": kv_full,
        "client_seen_errors": tally.errors, "server_log_errors": log_errors[:20],
        "server_log_error_lines": len(log_errors), "server_alive": alive,
        "live_idle": idle, "live_after_flush": end,
        "leaked": {k: idle[k] - end[k] if k.startswith("free") else end[k] - idle[k] for k in idle},
        "replay": replayed, "rss_start_mib": round(rss_start / 2 ** 20, 1), "rss": soak.rss_growth(curve),
        "rss_curve": curve,
        # which process grows: SGLang's scheduler holds the pool and the model, the launcher the HTTP server and the
        # tokenizer manager
        "rss_by_process": {role: soak.rss_growth(c) for role, c in sorted(by_role.items())},
        # the allocator and oneDNN settings a run was made under (glibc's MALLOC_*, oneDNN's primitive cache)
        "memory_env": {k: v for k, v in sorted(os.environ.items())
                       if k.startswith(("MALLOC_", "ONEDNN_", "DNNL_")) or k == "LD_PRELOAD"},
    }


def new_tokens_range(text: str) -> tuple[int, int]:
    """'LO,HI' -> (LO, HI), with 1 <= LO <= HI."""
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise SystemExit(f"--new-tokens {text!r}: expected LO,HI, two integers (e.g. 8,48)") from None
    if not 1 <= lo <= hi:
        raise SystemExit(f"--new-tokens {text!r}: expected 1 <= LO <= HI (e.g. 8,48)")
    return lo, hi


def refusal(dtype: str, mode: str) -> str | None:
    """Why the dtype refuses the mode's knobs (specache prefills in full: no deterministic mode), or None."""
    from sgl_kvq.config import KVQConfigError, is_kvq_dtype, parse_kv_cache_dtype

    if not is_kvq_dtype(dtype):
        return None
    saved = {k: os.environ.get(k) for k in MODES[mode]}
    os.environ.update(MODES[mode])
    try:
        parse_kv_cache_dtype(dtype)
    except KVQConfigError as e:
        return str(e)
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return None


def verdict(row: dict) -> list[str]:
    """What a run got wrong, in words (empty: it passed)."""
    bad = []
    if not row["server_alive"]:
        bad.append("the server died")
    if row["counts"]["server_errors"]:
        bad.append(f"{row['counts']['server_errors']} server errors: {row['client_seen_errors'][:3]}")
    if row["server_log_error_lines"]:
        bad.append(f"{row['server_log_error_lines']} error lines in the server log: {row['server_log_errors'][:3]}")
    if row["counts"]["client_errors"]:
        bad.append(f"{row['counts']['client_errors']} unexpected answers: {row['client_seen_errors'][:3]}")
    if row["counts"]["malformed"] != row["counts"]["malformed_4xx"]:
        bad.append("a malformed request did not get a 4xx")
    leaked = {k: v for k, v in row["leaked"].items() if v and k not in ("running_requests", "waiting_requests")}
    if leaked:
        bad.append(f"leaked after /flush_cache: {leaked}")
    if row["mode"] == "deterministic" and row["replay"]["identical"] != row["replay"]["turns"]:
        bad.append(f"{row['replay']['turns'] - row['replay']['identical']} turns differ from their replay")
    if row["rss"]["growth_mib"] is not None and row["rss"]["growth_mib"] > RSS_GROWTH_MIB:
        bad.append(f"resident memory grew {row['rss']['growth_mib']} MiB after warm-up")
    return bad


def plot(rows: list[dict], path: str):
    """The server processes' resident memory against time under load, one line per dtype x mode; writes `path` and
    returns the Figure (None, and nothing written, where no run has a memory curve)."""
    from bench.plots import finite, pyplot

    curves = [(f"{'bf16' if row['dtype'] == 'auto' else row['dtype']} {row['mode']}",
               finite((t, rss / 2**20) for t, rss in row.get("rss_curve") or [])) for row in rows]
    curves = [(label, pts) for label, pts in curves if pts]
    if not curves:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, pts in curves:
        ax.plot(*zip(*pts), label=label)
    ax.set_xlabel("time under load (s)")
    ax.set_ylabel("server processes' RSS (MiB)")
    ax.set_title("sgl-kvq bench soak: resident memory under load")
    ax.legend(title="kv dtype, mode")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


def run(args) -> int:
    import sys
    import tempfile

    from bench.launch import run_file
    from bench.models import BUILDERS

    model = BUILDERS[args.model]() if args.model in BUILDERS else Path(args.model)
    logs = Path(args.logs or tempfile.mkdtemp(prefix="kvq-soak-"))
    logs.mkdir(parents=True, exist_ok=True)
    command = "sgl-kvq bench soak " + " ".join(getattr(args, "_argv", sys.argv[3:]))
    report = {"command": command, "model": str(args.model), "max_total_tokens": args.max_total_tokens,
              "rss_growth_bound_mib": RSS_GROWTH_MIB, "runs": []}
    if args.append and args.json and Path(args.json).exists():
        old = json.loads(Path(args.json).read_text())
        report["command"], report["runs"] = old["command"] + " ; " + command, old["runs"]
    failed = False
    for dtype in [d for d in args.dtypes.split(",") if d]:
        for mode in [m for m in args.modes.split(",") if m]:
            refused = refusal(dtype, mode)
            if refused:
                print(f"{dtype} {mode}: not run: {refused}", flush=True)
                continue
            row = soak_one(model, dtype, mode, args.seconds, args.clients, args.max_total_tokens,
                           run_file(logs, dtype, mode), args.replay_max, args.test_retract,
                           new_tokens_range(args.new_tokens), args.max_conversation,
                           tuple(shlex.split(args.server_args)), args.stop_at_eos)
            row["problems"] = verdict(row)
            failed |= bool(row["problems"])
            report["runs"].append(row)
            c = row["counts"]
            print(f"{dtype} {mode}: {c['turns']} turns, {c['streams']} streams, {c['stream_disconnects']} "
                  f"disconnects, {c['aborted']}/{c['aborts_sent']} aborted, {c['malformed_4xx']}/{c['malformed']} "
                  f"malformed refused; {row['retracted_requests']} retractions "
                  f"({row['retracted_because_full']} pool full), "
                  f"{row['evicted_tokens']} evicted "
                  f"tokens; replay {row['replay']['identical']}/{row['replay']['turns']} identical "
                  f"(agreement {row['replay']['agreement']}); RSS {row['rss']}; by process "
                  f"{ {k: v['slope_mib_per_hour'] for k, v in row['rss_by_process'].items()} } MiB/h; "
                  f"problems: {row['problems'] or 'none'}",
                  flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
            if args.png:
                plot(report["runs"], args.png)
    return 1 if failed else 0


if __name__ == "__main__":
    from bench.commands._subcommands import standalone_main

    raise SystemExit(standalone_main(__name__))
