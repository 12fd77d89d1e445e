"""`sgl-kvq bench capacity`: KV token capacity of each dtype over a sweep of KV budgets, read from live servers.

Each budget is either SGLang's own sizing at a `--mem-fraction-static` value (what a user who sets nothing else
gets) or a budget pinned with KVQ_KV_CACHE_GB (equal memory for every dtype). No other flag is passed: each kvq
dtype picks its own max_running_requests from the budget (sgl_kvq/capacity.py). Capacity is what the server reports
(max_total_num_tokens); the budget is what its pool was sized from, so `x bf16 per GiB` compares tokens per byte of
budget even where a profiled budget moved between two servers. SGLang's fp8_e4m3 is tried too: where it does not
start (the CPU engine without Intel AMX) the refusal is recorded.

Capacity idle is half of it; the other half is how many requests a server runs at once when they arrive together.
Each server also gets a burst (`--burst N`: N requests of `--burst-prompt-tokens` distinct tokens, sent at once, a
few output tokens each), and the row records the peak of running requests its scheduler logged (every step logs:
--decode-log-interval 1) beside max_running_requests, the limit it could have run."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_DTYPES = "auto,fp8_e4m3,kivi4,kivi2,kivi1,specache2,specache1"


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2 | gemma3 | tiny | a model folder")
    p.add_argument("--kv-cache-dtype", default=DEFAULT_DTYPES, help="comma list; auto = the model's bf16")
    p.add_argument("--mem-fraction-static", default="0.03,0.05,0.1",
                   help="comma list of SGLang --mem-fraction-static values (SGLang's own sizing); '' for none")
    p.add_argument("--kv-cache-gb", default="0.25,1,4", help="comma list of pinned KV budgets in GiB; '' for none")
    p.add_argument("--burst", type=int, default=32,
                   help="requests sent at once to each server, whose peak of running requests is recorded; 0: none")
    p.add_argument("--burst-prompt-tokens", type=int, default=512, help="distinct prompt tokens per burst request")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH", help="PNG: capacity ratio to bf16 vs KV budget, one line per dtype")


def budgets(args) -> list[dict]:
    out = [{"mem_fraction_static": float(x)} for x in args.mem_fraction_static.split(",") if x]
    return out + [{"kv_cache_gb": float(x)} for x in args.kv_cache_gb.split(",") if x]


def label(budget: dict) -> str:
    if "kv_cache_gb" in budget:
        return f"KVQ_KV_CACHE_GB={budget['kv_cache_gb']:g}"
    return f"--mem-fraction-static {budget['mem_fraction_static']:g}"


BURST_NEW_TOKENS = 4  # enough decode steps for every admitted request to show in a "Decode batch" line


def burst(server, vocab_size: int, requests: int, prompt_tokens: int) -> None:
    """`requests` prompts of `prompt_tokens` token ids each, all distinct (no radix hit between them), sent at once.
    Ids are drawn above the first tenth of the vocabulary, past the special tokens."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(0)
    prompts = [[rng.randrange(vocab_size // 10, vocab_size) for _ in range(prompt_tokens)] for _ in range(requests)]
    greedy = {"temperature": 0, "max_new_tokens": BURST_NEW_TOKENS, "ignore_eos": True}
    with ThreadPoolExecutor(requests) as pool:
        outs = list(pool.map(lambda ids: server.post("/generate", {"input_ids": ids, "sampling_params": greedy}),
                             prompts))
    assert all(o["meta_info"]["completion_tokens"] == BURST_NEW_TOKENS for o in outs), "a burst request fell short"


def measure(model, dtype: str, budget: dict, log_path: Path, burst_requests: int = 0,
            burst_prompt_tokens: int = 512) -> dict:
    """One server: its pool statistics (with the peak of running requests of a burst), or why it did not start.
    dtype: a dtype, or one with knobs of its own (`kivimix:KVQ_RECIPE=smollm2-3.0`: engine_eval.split_knobs)."""
    from bench.commands.serving_stats import scheduler_log_stats
    from bench.eval.engine_eval import split_knobs
    from bench.launch import ServerProcess, baseline_page_size

    dtype, knobs = split_knobs(dtype)
    args = ["--model-path", str(model)] + (["--decode-log-interval", "1"] if burst_requests else [])
    args += ["--page-size", str(baseline_page_size())] if not dtype.startswith(("kivi", "specache")) else []
    args += [] if dtype == "auto" else ["--kv-cache-dtype", dtype]
    env = dict(os.environ)
    os.environ.pop("KVQ_KV_CACHE_GB", None)
    os.environ.update(knobs)
    if "kv_cache_gb" in budget:
        os.environ["KVQ_KV_CACHE_GB"] = str(budget["kv_cache_gb"])
    else:
        args += ["--mem-fraction-static", str(budget["mem_fraction_static"])]
    try:
        with ServerProcess(args, log_path=log_path) as server:
            stats = server.kv_pool_stats()
            # The pool must really hold what it claims: a request round-trips.
            server.post("/generate", {"text": "capacity check", "sampling_params": {"max_new_tokens": 4}})
            if burst_requests:
                start = len(log_path.read_text(errors="replace"))
                vocab_size = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
                burst(server, vocab_size, burst_requests, burst_prompt_tokens)
        if burst_requests:
            peak = scheduler_log_stats(log_path.read_text(errors="replace")[start:])["peak_running_requests"]
            stats.update(burst_requests=burst_requests, burst_prompt_tokens=burst_prompt_tokens,
                         peak_running_requests=peak)
        return stats
    except RuntimeError as e:
        return {"refused": startup_error(log_path) or str(e).splitlines()[0]}
    finally:
        os.environ.clear()
        os.environ.update(env)


def startup_error(log_path: Path) -> str | None:
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    errors = re.findall(r"^(?:\w*Error|Exception): (.+)$", text, flags=re.M)
    return errors[-1].strip() if errors else None


def ratios(rows: list[dict]) -> None:
    """Capacity against bf16 ("auto") at the same budget setting: raw, and per GiB of the budget each pool had."""
    base = {r["budget_label"]: r for r in rows if r["kv_cache_dtype"] == "auto" and "capacity_tokens" in r}
    for r in rows:
        b = base.get(r["budget_label"])
        if b is None or "capacity_tokens" not in r:
            continue
        r["x_bf16"] = r["capacity_tokens"] / b["capacity_tokens"]
        if r.get("kv_budget_bytes") and b.get("kv_budget_bytes"):
            r["x_bf16_per_budget"] = (r["capacity_tokens"] / r["kv_budget_bytes"]) / (
                b["capacity_tokens"] / b["kv_budget_bytes"])


def table(rows: list[dict]) -> str:
    lines = ["| budget | kv dtype | KV budget GiB | capacity tokens | max running | peak running (burst) | "
             "per-request state | x bf16 | x bf16 per GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['budget_label']} | {r['kv_cache_dtype']} | - | refused: {r['refused']} | | | | | |")
            continue
        share = r.get("request_state_bytes", 0) / r["kv_budget_bytes"] if r.get("kv_budget_bytes") else 0
        peak = f"{r['peak_running_requests']} of {r['burst_requests']}" if "burst_requests" in r else "-"
        lines.append(f"| {r['budget_label']} | {r['kv_cache_dtype']} | {r.get('kv_budget_bytes', 0) / 2**30:.3f} | "
                     f"{r['capacity_tokens']:,} | {r.get('max_running_requests', '-')} | {peak} | {share:.1%} | "
                     f"{r.get('x_bf16', float('nan')):.2f} | {r.get('x_bf16_per_budget', float('nan')):.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str):
    """Capacity per GiB of budget against bf16's, one axes per way of sizing the pool that has rows (SGLang's
    default, a pinned budget), one line per dtype; writes `path` and returns the Figure (None, and nothing written,
    where no server reported a capacity)."""
    import matplotlib.ticker

    from bench.plots import finite, pyplot, ticks_at

    plt = pyplot()
    panels = []
    for kind, title in (("mem_fraction_static", "SGLang's default sizing (--mem-fraction-static)"),
                        ("kv_cache_gb", "pinned KV budget (KVQ_KV_CACHE_GB)")):
        # Tokens per byte of each server's own budget: a profiled budget moves with other processes' memory.
        lines = {dtype: finite((r["kv_budget_bytes"] / 2**30, r["x_bf16_per_budget"]) for r in rows
                               if r["kv_cache_dtype"] == dtype and kind in r["budget"] and "x_bf16_per_budget" in r)
                 for dtype in dict.fromkeys(r["kv_cache_dtype"] for r in rows)}
        lines = {dtype: pts for dtype, pts in lines.items() if pts}
        if lines:
            panels.append((title, lines))
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 4.5), sharey=True, squeeze=False)
    for ax, (title, lines) in zip(axes[0], panels):
        for dtype, pts in lines.items():
            ax.plot(*zip(*pts), marker="o", label="bf16" if dtype == "auto" else dtype)
        ax.set_xscale("log")
        budgets = {x for pts in lines.values() for x, _ in pts}
        if len(budgets) <= 6:  # pinned budgets: the same few values for every dtype
            ticks_at(ax, budgets)
        else:  # profiled budgets differ per server: round ticks
            ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))  # 0.2, 0.5, 1, 2 GiB
            ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xlabel("KV budget of the server (GiB)")
        ax.set_ylabel("tokens per GiB of budget (x bf16's)")
        ax.tick_params(labelleft=True)  # shared y, but each panel reads on its own
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(title="kv dtype", fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # the lines span x
    refused = {r["kv_cache_dtype"]: r["refused"] for r in rows if "refused" in r}
    if refused:
        fig.text(0.01, 0.01, "did not start: " + "; ".join(f"{d}: {why}" for d, why in refused.items()), fontsize=8)
    fig.tight_layout(rect=(0, 0.04 if refused else 0, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig


def run(args) -> int:
    from bench.commands import bench_multiturn
    from bench.launch import run_file

    model = bench_multiturn.resolve_model(args.model)
    log_dir = Path(tempfile.mkdtemp(prefix="sgl-kvq-capacity-"))
    dtypes = [d for d in args.kv_cache_dtype.split(",") if d]
    plan = [(b, d) for b in budgets(args) for d in dtypes]
    rows, refused = [], {}
    print(f"capacity sweep: {len(plan)} servers ({args.model}; logs in {log_dir})", flush=True)
    for i, (budget, dtype) in enumerate(plan, 1):
        t0 = time.time()
        if dtype in refused:  # a dtype the engine refuses at one budget is refused at every budget
            row = {"refused": refused[dtype], "skipped": True}
        else:
            row = measure(model, dtype, budget, run_file(log_dir, dtype, str(i)), args.burst, args.burst_prompt_tokens)
            if "refused" in row:
                refused[dtype] = row["refused"]
        row.update(kv_cache_dtype=dtype, budget=budget, budget_label=label(budget))
        rows.append(row)
        what = row.get("refused") or f"{row['capacity_tokens']:,} tokens" + (
            f", {row['peak_running_requests']} of {row['burst_requests']} running at once" if "burst_requests" in row
            else "")
        print(f"[{i}/{len(plan)}] {label(budget)} {dtype}: {what} ({time.time() - t0:.0f}s)", flush=True)
    ratios(rows)
    print(table(rows))
    if args.json:
        command = "sgl-kvq " + shlex.join(getattr(args, "_argv", None) or sys.argv[1:])
        from sgl_kvq import env

        report = {"model": args.model, "command": command, **env.run_record(), "runs": rows}
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    if args.plot and plot(rows, args.plot) is None:
        print(f"no plot at {args.plot}: no server reported a capacity")
    return 0
