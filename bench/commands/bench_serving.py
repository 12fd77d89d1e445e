"""`sgl-kvq bench serving`: SGLang's own load generator (`python -m sglang.benchmark.serving`) against one server per
KV dtype at the same pinned KV budget (KVQ_KV_CACHE_GB), for a multi-turn shared-prefix workload, a ShareGPT one and an
agentic one (--workload agentic: long conversations replayed turn by turn, each turn a request and a tool's output of
essay text, the server's real replies fed back), at several concurrencies, in two budget regimes: "tight" (bf16's
budget is the bottleneck at the top concurrency: sized so kivi2 holds every conversation's tokens at once, which leaves
bf16 about a sixth of them) and "generous" (bf16 holds twice what the top concurrency needs). Every server gets
--decode-log-interval 1, and runs with each of --flags: "default" (no --max-running-requests: what a user who sets
nothing gets) and "explicit" (--max-running-requests = the top concurrency, or the most the budget allows a kvq dtype:
sgl_kvq/capacity.py). Ratios to bf16 compare servers of the same flags."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

from bench.commands import serving_stats as stats
from bench.commands import serving_workloads as wl
from bench.commands.machine import describe

DEFAULT_DTYPES = "auto,kivi4,kivi2,specache2"
REGIMES = ("tight", "generous")

SOURCES = """where each number comes from:
  throughput, TTFT / TPOT / ITL percentiles, completed requests: the load generator's own JSON (--output-file);
  cached tokens / prompt tokens ("cache_report"): the load generator's --cache-report, from each response's
    meta_info cached_tokens (measured requests only); agentic: "cached_share_by_turn", the same per turn, from the
    per-request arrays of its --output-details;
  capacity_tokens (SGLang's max_total_num_tokens), max_running_requests, kv_budget_bytes, bytes per token:
    /get_server_info internal_states[0]["kv_pool"] (the live pool), effective_max_running_requests: the scheduler's
    own internal_states[0]["effective_max_running_requests_per_dp"];
  peak running requests, peak queue, peak token usage, retractions, server-side cached-token share: the server log's
    "Decode batch" / "Prefill batch" lines (#running-req, #queue-req, token usage, #new-token, #cached-token) and
    "KV cache pool is full. Retract requests. #retracted_reqs: N" warnings, sliced to each run (its warmup included);
  SpeCache's prefetched bytes per decode step, speculative-token hit rate and top-k recall: the difference of
    kv_pool["specache"]'s counters before and after each run.
The load generator runs in this process (its cli_main with the recorded argv, so its 15 s import is paid once); each
run's `loadgen_command` is the same run as a standalone command line. It flushes the radix cache after its warmup
(--flush-cache), so no run starts with the previous run's prompts cached."""


def add_arguments(p) -> None:
    p.formatter_class, p.epilog = argparse.RawDescriptionHelpFormatter, SOURCES
    p.add_argument("--model", default="smollm2", help="smollm2 | gemma3 | tiny | a model folder")
    p.add_argument("--kv-cache-dtype", default=DEFAULT_DTYPES,
                   help="comma list; auto = the model's bf16 (baseline); an entry may carry knobs for its server "
                   "only, as kivi4:KVQ_PREFILL=paged")
    p.add_argument("--concurrency", default="1,4,16", help="comma list of the load generator's --max-concurrency")
    p.add_argument("--workload", default="shared-prefix,sharegpt", help="comma list: shared-prefix, sharegpt, "
                   "agentic")
    p.add_argument("--regime", default=",".join(REGIMES), help="comma list: tight, generous")
    p.add_argument("--kv-cache-gb-tight", type=float, help="the tight regime's KV budget (GiB); default: the "
                   "smallest at which kivi2 holds every conversation of the top concurrency, +10%%")
    p.add_argument("--kv-cache-gb-generous", type=float,
                   help="the generous regime's KV budget (GiB); default: bf16 holds 2x the top concurrency's tokens")
    p.add_argument("--waves", type=int, default=2, help="conversations (ShareGPT: prompts) per run = WAVES x its "
                   "concurrency, so every run keeps its concurrency busy for about WAVES rounds")
    p.add_argument("--groups", type=int, default=4, help="shared-prefix: system prompt groups (the conversations "
                   "are spread over them)")
    p.add_argument("--turns", type=int, default=2, help="shared-prefix: turns per conversation (2 or more)")
    p.add_argument("--system-prompt-len", type=int, default=256, help="shared-prefix: tokens")
    p.add_argument("--question-len", type=int, default=64, help="shared-prefix: tokens per turn")
    p.add_argument("--output-len", type=int, default=32, help="output tokens per request (per turn), every "
                   "workload")
    p.add_argument("--agentic-turns", type=int, default=8, help="agentic: turns per conversation")
    p.add_argument("--agentic-turn-tokens", type=int, default=900, help="agentic: tokens of each turn's user "
                   "message (a ShareGPT request and essay text as a tool's output), so a conversation grows to about "
                   "TURNS x (TURN_TOKENS + --output-len); refused where that passes the model's context length")
    p.add_argument("--sharegpt-context-len", type=int, default=512,
                   help="ShareGPT prompts longer than this minus --output-len are skipped by the load generator")
    p.add_argument("--flags", default="default,explicit", help="comma list: default (no --max-running-requests), "
                   "explicit (--max-running-requests = the top concurrency, or the most a kvq budget allows)")
    p.add_argument("--server-args", default="", help="extra launch_server flags for every server, e.g. '--dtype "
                   "float32'")
    p.add_argument("--quick", action="store_true", help="a short run: concurrency 1,4, 2 groups, shorter prompts, 8 "
                   "output tokens, agentic: 2 turns of 128 tokens")
    p.add_argument("--json", metavar="PATH", help="results (default serving-MODEL.json); plots are written beside "
                   "it as PATH-stem-WORKLOAD-REGIME.png")


def apply_quick(args) -> None:
    if args.quick:
        args.concurrency, args.groups = "1,4", 2
        args.system_prompt_len, args.question_len, args.output_len = 128, 32, 8
        args.sharegpt_context_len = 256
        args.agentic_turns, args.agentic_turn_tokens = 2, 128


def workloads(args, sharegpt_file: Path, concurrency: int, agentic_file: Path | None = None) -> list[wl.Workload]:
    chosen = [w for w in args.workload.split(",") if w]
    conversations = args.waves * concurrency
    out = []
    if "shared-prefix" in chosen:
        groups = min(args.groups, conversations)
        out.append(wl.shared_prefix_workload(groups, -(-conversations // groups), args.turns, args.system_prompt_len,
                                             args.question_len, args.output_len))
    if "sharegpt" in chosen:
        out.append(wl.sharegpt_workload(sharegpt_file, conversations, args.output_len, args.sharegpt_context_len))
    if "agentic" in chosen:
        out.append(wl.agentic_workload(agentic_file, conversations, args.agentic_turns, args.agentic_turn_tokens,
                                       args.output_len))
    return out


def write_agentic_trace(args, model: Path, path: Path, conversations: int) -> str | None:
    """The agentic trace for `conversations` conversations at `path`; why not, where its longest conversation would
    not fit the model's context (SGLang refuses a request whose prompt and output pass it)."""
    wl.write_agentic_trace(path, model, conversations, args.agentic_turns, args.agentic_turn_tokens, args.output_len)
    longest = json.loads(path.read_text())["metadata"]["longest_context_tokens"]
    context = json.loads((model / "config.json").read_text()).get("max_position_embeddings")
    if context and longest > context:
        return (f"agentic: a conversation reaches {longest} tokens at its last turn, past the model's context length "
                f"({context}); lower --agentic-turns or --agentic-turn-tokens")
    return None


def regime_budgets(args, shape: wl.ModelShape, loads: list[wl.Workload], top: int) -> dict[str, int]:
    """Bytes per regime, rounded up to whole MiB (what KVQ_KV_CACHE_GB carries to the servers exactly)."""
    chosen = [r for r in args.regime.split(",") if r]
    given = {"tight": args.kv_cache_gb_tight, "generous": args.kv_cache_gb_generous}
    derive = {"tight": wl.bottleneck_budget, "generous": wl.generous_budget}
    mib = 2**20
    return {r: int(given[r] * 2**30) if given[r] else -(-derive[r](shape, loads, top) // mib) * mib for r in chosen}


def run_loadgen(argv: list[str]) -> str | None:
    """SGLang's load generator with `argv`, in this process; the error if it exits with one."""
    from sglang.benchmark import serving

    saved = sys.argv
    sys.argv = ["sglang.benchmark.serving", *argv]
    try:
        serving.cli_main()
    except SystemExit as e:
        return None if e.code in (0, None) else f"load generator exited with {e.code}"
    except Exception as e:  # one failed run must not lose the other servers' results
        return f"{type(e).__name__}: {e}"
    finally:
        sys.argv = saved
    return None


def measure(server, model: Path, load: wl.Workload, concurrency: int, out_file: Path) -> dict:
    argv = [*load.loadgen_args, "--host", "127.0.0.1", "--port", str(server.port), "--model", str(model),
            "--tokenizer", str(model), "--max-concurrency", str(concurrency), "--output-file", str(out_file),
            "--cache-report", "--flush-cache", "--seed", "1"]
    log_start = server.log_path.stat().st_size
    spec_before = server.kv_pool_stats().get("specache")
    error = run_loadgen(argv)
    time.sleep(0.5)  # the scheduler's last log lines of the run
    with open(server.log_path, errors="replace") as f:
        f.seek(log_start)
        log = f.read()
    by_turn = {"cached_share_by_turn": stats.cached_share_by_turn(out_file, load.turns)} if load.turns > 1 else {}
    return {"loadgen_command": "python -m sglang.benchmark.serving " + shlex.join(argv), "error": error,
            "loadgen": stats.loadgen_result(out_file), **by_turn, "server": stats.scheduler_log_stats(log),
            "specache": stats.specache_delta(spec_before, server.kv_pool_stats().get("specache"))}


def serve_dtype(model: Path, dtype: str, budget: int, max_running: int | None, extra: list[str], log: Path):
    from bench.launch import ServerProcess, baseline_page_size

    server_args = ["--model-path", str(model), "--decode-log-interval", "1", *extra]
    server_args += [] if max_running is None else ["--max-running-requests", str(max_running)]
    server_args += ["--page-size", str(baseline_page_size())] if dtype == "auto" else ["--kv-cache-dtype", dtype]
    os.environ["KVQ_KV_CACHE_GB"] = repr(budget / 2**30)
    return ServerProcess(server_args, log_path=log)


def run(args) -> int:
    from bench.commands.bench_capacity import startup_error
    from bench.commands.bench_multiturn import resolve_model
    from bench.eval.engine_eval import knob_env, split_knobs
    from bench.launch import run_file

    apply_quick(args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    model = resolve_model(args.model)
    shape = wl.ModelShape.of(model)
    tmp = Path(tempfile.mkdtemp(prefix="sgl-kvq-serving-"))
    concurrencies = [int(c) for c in args.concurrency.split(",") if c]
    top = max(concurrencies)
    sharegpt_file = tmp / "sharegpt.json"
    if "sharegpt" in args.workload:
        wl.write_sharegpt_file(sharegpt_file, records=max(500, 40 * args.waves * top))
    agentic_file = tmp / "agentic-trace.json"
    if "agentic" in args.workload:
        refused = write_agentic_trace(args, model, agentic_file, args.waves * top)
        if refused:
            print(refused, file=sys.stderr)
            return 2
    loads = {c: workloads(args, sharegpt_file, c, agentic_file) for c in concurrencies}
    dtypes = [d for d in args.kv_cache_dtype.split(",") if d]
    knobs = {d: split_knobs(d) for d in dtypes}  # entry -> (dtype, its server's KVQ_ knobs), checked before any server
    budgets = regime_budgets(args, shape, loads[top], top)
    command = "sgl-kvq " + shlex.join(getattr(args, "_argv", None) or sys.argv[1:])
    report = {"command": command, "model": args.model, "machine": describe(), "concurrencies": concurrencies,
              "kv_cache_dtypes": dtypes,
              "workloads": {c: [workload_info(w, c) for w in loads[c]] for c in concurrencies},
              "regimes": {}, "servers": [], "runs": [], "sources": SOURCES}
    print(f"serving benchmark: {args.model}, {len(budgets) * len(dtypes)} servers, logs in {tmp}", flush=True)
    for regime, budget in budgets.items():
        predicted = {}
        for d in dtypes:
            with knob_env(knobs[d][1]):
                predicted[d] = wl.predicted_pool(shape, knobs[d][0], budget, top)
        report["regimes"][regime] = {"kv_cache_gb": budget / 2**30, "predicted": predicted}
        for dtype, flags in [(d, f) for d in dtypes for f in args.flags.split(",") if f]:
            t0 = time.time()
            label = f"[{regime} {budget / 2**30:.3f} GiB] {dtype} ({flags} flags)"
            row = {"regime": regime, "kv_cache_dtype": dtype, "flags": flags, "kv_cache_gb": budget / 2**30}
            if "refused" in predicted[dtype]:
                report["servers"].append({**row, "refused": predicted[dtype]["refused"]})
                print(f"{label}: refused at this budget: {predicted[dtype]['refused']}", flush=True)
                continue
            log = run_file(tmp, "server", regime, dtype, flags)
            print(f"{label}: starting the server (log {log})", flush=True)
            max_running = predicted[dtype]["max_running_requests"] if flags == "explicit" else None
            try:
                extra = shlex.split(args.server_args)
                with knob_env(knobs[dtype][1]), \
                        serve_dtype(model, knobs[dtype][0], budget, max_running, extra, log) as server:
                    # the row's dtype entry (with its knobs) names the server, not the pool's dtype name
                    report["servers"].append({**stats.server_summary(server.get("/get_server_info")), **row})
                    for kind in range(len(loads[top])):  # each workload, at every concurrency
                        for c in concurrencies:
                            load = loads[c][kind]
                            out = measure(server, model, load, c, run_file(tmp, "loadgen", regime, dtype, flags,
                                                                           load.name, f"c{c}", suffix=".jsonl"))
                            report["runs"].append({**row, "workload": load.name, "concurrency": c, **out})
                            print(f"{label} {load.name} c={c}: {brief(out)}", flush=True)
            except (RuntimeError, TimeoutError) as e:  # a server that does not start: its reason, then the next
                report["servers"].append({**row, "refused": startup_error(log) or str(e).splitlines()[0]})
            print(f"{label}: done in {time.time() - t0:.0f}s", flush=True)
            save(report, Path(args.json or f"serving-{args.model}.json"), [w.name for w in loads[top]], budgets)
    print(stats.table(report))
    return 0


def save(report: dict, path: Path, workload_names: list[str], budgets: dict[str, int]) -> None:
    """The JSON and one plot per workload x regime; rewritten after every server, so a run cut short keeps what it
    measured."""
    add_ratios(report["runs"])
    path.write_text(json.dumps(report, indent=1) + "\n")
    for name in workload_names:
        for regime, budget in budgets.items():
            if not any(r["workload"] == name and r["regime"] == regime for r in report["runs"]):
                continue  # not measured (yet)
            title = f"{report['model']}: {name}, {regime} KV budget ({budget / 2**30:.3f} GiB per server)"
            if len(report["concurrencies"]) > 1:  # numbers against concurrency: one point is no line
                stats.plot(report["runs"], name, regime, title, path.with_name(f"{path.stem}-{name}-{regime}.png"))
            for c in report["concurrencies"]:  # multi-turn replays: what each turn found cached
                stats.plot_turns(report["runs"], name, regime, c, f"{title}, concurrency {c}",
                                 path.with_name(f"{path.stem}-{name}-{regime}-c{c}-turns.png"))


def workload_info(load: wl.Workload, concurrency: int) -> dict:
    return {"name": load.name, "loadgen_args": shlex.join(load.loadgen_args), "conversations": load.conversations,
            "tokens_per_conversation_bound": load.tokens_per_conversation, "peak_tokens": load.peak_tokens(concurrency),
            "peak_tokens_prefix_shared": load.peak_tokens(concurrency, shared=True)}


def brief(out: dict) -> str:
    m, s = out["loadgen"], out["server"]
    if not m:
        return f"no result ({out['error']})"
    by_turn = out.get("cached_share_by_turn")
    turns = f" ({', '.join(f'{x:.0%}' for x in by_turn)} by turn)" if by_turn else ""
    return (f"{m['output_throughput']:.1f} out tok/s, TTFT p50/p90/p99 {m['median_ttft_ms']:.0f}/"
            f"{m['p90_ttft_ms']:.0f}/{m['p99_ttft_ms']:.0f} ms, p99 ITL {m['p99_itl_ms']:.0f} ms, peak running "
            f"{s['peak_running_requests']}, retracted {s['retracted_requests']}, cached {s['cached_token_share']:.0%}"
            f"{turns}")


def add_ratios(runs: list[dict]) -> None:
    """Output throughput over bf16's ("auto") in the same regime, flags, workload and concurrency."""
    def key(r):
        return r["regime"], r.get("flags", "explicit"), r["workload"], r["concurrency"]

    base = {key(r): r["loadgen"].get("output_throughput") for r in runs if r["kv_cache_dtype"] == "auto"}
    for r in runs:
        b = base.get(key(r))
        if b and r["loadgen"].get("output_throughput"):
            r["output_throughput_vs_bf16"] = r["loadgen"]["output_throughput"] / b
