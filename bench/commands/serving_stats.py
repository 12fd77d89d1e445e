"""What `sgl-kvq bench serving` reads back: the load generator's JSON line, the server's scheduler log (slice per run),
the pool's counters from /get_server_info, and the plots. Pure functions except `plot`."""

from __future__ import annotations

import json
import re
from pathlib import Path

# The load generator's own numbers kept per run (its JSON has these keys; "server_info" and the per-request arrays
# are dropped: the server's state is read separately, before and after the run).
LOADGEN_KEYS = ("completed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
                "input_throughput", "output_throughput", "total_throughput", "max_concurrent_requests",
                "mean_ttft_ms", "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
                "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p90_itl_ms", "p99_itl_ms", "mean_e2e_latency_ms",
                "p99_e2e_latency_ms", "cache_report")

_RUNNING = re.compile(r"(Decode|Prefill) batch\b.*?#running-req: (\d+)")
_QUEUE = re.compile(r"(?:Decode|Prefill) batch\b.*?#queue-req: (\d+)")
_USAGE = re.compile(r"(?:Decode|Prefill) batch\b.*?\btoken usage: ([0-9.]+)")
_PREFILL = re.compile(r"Prefill batch\b.*?#new-token: (\d+), #cached-token: (\d+)")
_RETRACT = re.compile(r"Retract requests\. #retracted_reqs: (\d+)")


def scheduler_log_stats(text: str) -> dict:
    """SGLang's scheduler log lines (with --decode-log-interval 1, every decode step logs): the most requests running
    at once (`#running-req` of "Decode batch"/"Prefill batch" lines), the longest waiting queue, the highest pool
    usage, retraction events and retracted requests ("KV cache pool is full. Retract requests" warnings), and the
    prefill tokens the radix cache served (`#cached-token` over `#new-token` + `#cached-token` of "Prefill batch")."""
    new = sum(int(a) for a, _ in _PREFILL.findall(text))
    cached = sum(int(b) for _, b in _PREFILL.findall(text))
    retracts = [int(n) for n in _RETRACT.findall(text)]
    return {
        "peak_running_requests": max((int(n) for _, n in _RUNNING.findall(text)), default=0),
        "peak_queued_requests": max((int(n) for n in _QUEUE.findall(text)), default=0),
        "peak_token_usage": max((float(u) for u in _USAGE.findall(text)), default=0.0),
        "retraction_events": len(retracts),
        "retracted_requests": sum(retracts),
        "prefill_new_tokens": new,
        "prefill_cached_tokens": cached,
        "cached_token_share": cached / (new + cached) if new + cached else 0.0,
    }


def loadgen_result(path: Path) -> dict:
    """The last JSON line the load generator appended to its --output-file, reduced to LOADGEN_KEYS."""
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []
    if not lines:
        return {}
    result = json.loads(lines[-1])
    return {k: result[k] for k in LOADGEN_KEYS if k in result}


def cached_share_by_turn(path: Path, turns: int) -> list[float] | None:
    """Cached tokens over prompt tokens at each turn of a multi-turn run, over its conversations: from the per-request
    arrays of the load generator's last JSON line (--output-details), which list each conversation's requests in turn
    order, conversation after conversation; failed requests left out. None where the arrays are missing or do not
    split into whole conversations of `turns`."""
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []
    result = json.loads(lines[-1]) if lines else {}
    cached, prompt = result.get("cached_tokens"), result.get("input_lens")
    if not cached or not prompt or len(cached) != len(prompt) or len(cached) % turns:
        return None
    errors = result.get("errors") or [""] * len(cached)
    shares = []
    for t in range(turns):
        ok = [i for i in range(t, len(cached), turns) if not errors[i] and prompt[i]]
        total = sum(prompt[i] for i in ok)
        shares.append(sum(cached[i] for i in ok) / total if total else 0.0)
    return shares


def specache_delta(before: dict | None, after: dict | None) -> dict | None:
    """SpeCache's counters (kv_pool["specache"], cumulative over the server's life) over one run: prefetched bytes
    per decode step, the speculative token's hit rate and the top-k recall of that run alone."""
    if not before or not after:
        return None
    steps = after["decode_steps"] - before["decode_steps"]
    guesses = after["spec_token_guesses"] - before["spec_token_guesses"]
    hits = (after["spec_token_hit_rate"] or 0) * after["spec_token_guesses"] - \
        (before["spec_token_hit_rate"] or 0) * before["spec_token_guesses"]
    wanted = after["recall_wanted"] - before["recall_wanted"]
    found = (after["recall"] or 0) * after["recall_wanted"] - (before["recall"] or 0) * before["recall_wanted"]
    return {
        "top_k": after["top_k"],
        "decode_steps": steps,
        "prefetched_bytes": after["prefetched_bytes"] - before["prefetched_bytes"],
        "prefetched_bytes_per_step": (after["prefetched_bytes"] - before["prefetched_bytes"]) / steps if steps else 0,
        "spec_token_hit_rate": hits / guesses if guesses else None,
        "recall": found / wanted if wanted else None,
    }


def server_summary(info: dict) -> dict:
    """From /get_server_info: our pool stats (internal_states[0]["kv_pool"]; capacity_tokens is the scheduler's
    max_total_num_tokens) and the scheduler's own max_running_requests."""
    state = info["internal_states"][0]
    pool = state["kv_pool"]
    keys = ("kv_cache_dtype", "capacity_tokens", "max_running_requests", "kv_budget_bytes", "kv_bytes_per_token",
            "base_bytes_per_token", "request_state_bytes", "host_bytes_per_token")
    out = {k: pool[k] for k in keys if k in pool}
    if "config" in pool:  # the kvq pool's quantization config as the server resolved it (its knobs included)
        out["config"] = pool["config"]
    out["effective_max_running_requests"] = state.get("effective_max_running_requests_per_dp")
    return out


PLOT_PANELS = (("output_throughput", "output throughput (tok/s)"), ("p99_ttft_ms", "p99 TTFT (ms)"),
               ("p99_itl_ms", "p99 ITL (ms)"))


def plot(runs: list[dict], workload: str, regime: str, title: str, path: Path):
    """Output throughput, p99 TTFT and p99 ITL against concurrency, one line per server (dtype, flags), one axes per
    number the load generator reported; writes `path` and returns the Figure (None, and nothing written, where no run
    of this workload and regime has a load generator result)."""
    from bench.plots import finite, pyplot, ticks_at

    mine = [r for r in runs if r["workload"] == workload and r["regime"] == regime and r.get("loadgen")]
    names = list(dict.fromkeys(series(r) for r in mine))
    panels = []
    for key, ylabel in PLOT_PANELS:
        lines = {name: finite((r["concurrency"], r["loadgen"].get(key)) for r in mine if series(r) == name)
                 for name in names}
        lines = {name: pts for name, pts in lines.items() if pts}
        if lines:
            panels.append((ylabel, lines))
    if not panels:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), squeeze=False)
    concurrencies = sorted({r["concurrency"] for r in mine})
    for ax, (ylabel, lines) in zip(axes[0], panels):
        for name, pts in lines.items():
            ax.plot(*zip(*pts), marker="o", label=legend_name(name))
        ax.set_xscale("log", base=2)
        ticks_at(ax, concurrencies)
        _label(ax, "load generator's max concurrency (requests)", ylabel)
    return _save(plt, fig, title, path)


def _label(ax, xlabel: str, ylabel: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def _save(plt, fig, title: str, path: Path):
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


BUDGET_PANELS = (("output throughput (tok/s)", lambda r: r["loadgen"].get("output_throughput")),
                 ("peak running requests (requests)", lambda r: (r.get("server") or {}).get("peak_running_requests")))


def plot_budgets(runs: list[dict], workload: str, concurrency: int, title: str, path: Path):
    """Output throughput and the peak of running requests against the KV budget, one line per server (dtype,
    flags), over runs of several reports (each run carries its own kv_cache_gb); writes `path` and returns the
    Figure (None, nothing written, where no run of this workload and concurrency has a load generator result)."""
    from bench.plots import finite, pyplot, ticks_at

    mine = [r for r in runs if r["workload"] == workload and r["concurrency"] == concurrency and r.get("loadgen")]
    if not mine:
        return None
    names = list(dict.fromkeys(series(r) for r in mine))
    plt = pyplot()
    fig, axes = plt.subplots(1, len(BUDGET_PANELS), figsize=(5.5 * len(BUDGET_PANELS), 4.2), squeeze=False)
    budgets = sorted({round(r["kv_cache_gb"], 3) for r in mine})
    for ax, (ylabel, value) in zip(axes[0], BUDGET_PANELS):
        for name in names:
            pts = sorted(finite((round(r["kv_cache_gb"], 3), value(r)) for r in mine if series(r) == name))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=legend_name(name))
        ax.set_xscale("log", base=2)
        ticks_at(ax, budgets)
        _label(ax, "KV budget per server (GiB)", ylabel)
    return _save(plt, fig, title, path)


def plot_turns(runs: list[dict], workload: str, regime: str, concurrency: int, title: str, path: Path):
    """A multi-turn replay at one concurrency: each server's cached share by turn (what the radix cache kept of each
    conversation), its output throughput and its TTFT p50 / p90; writes `path` and returns the Figure (None, nothing
    written, where no run has per-turn shares)."""
    from bench.plots import pyplot

    mine = [r for r in runs if r["workload"] == workload and r["regime"] == regime and r["concurrency"] == concurrency
            and r.get("loadgen") and r.get("cached_share_by_turn")]
    if not mine:
        return None
    names = [legend_name(series(r)) for r in mine]
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    for r, name in zip(mine, names):
        shares = r["cached_share_by_turn"]
        axes[0].plot(range(1, len(shares) + 1), [100 * x for x in shares], marker="o", label=name)
    _label(axes[0], "turn", "prompt tokens cached (%)")
    at = range(len(mine))
    axes[1].bar(at, [r["loadgen"]["output_throughput"] for r in mine])
    axes[1].set_ylabel("output throughput (tok/s)")
    width = 0.4
    p50, p90 = ([r["loadgen"][key] / 1000 for r in mine] for key in ("median_ttft_ms", "p90_ttft_ms"))
    axes[2].bar([x - width / 2 for x in at], p50, width, label="p50")
    axes[2].bar([x + width / 2 for x in at], p90, width, label="p90")
    axes[2].set_ylabel("TTFT (s, log scale)")
    axes[2].set_yscale("log")
    axes[2].set_ylim(bottom=min(p50 + p90) / 2)
    axes[2].legend(fontsize=8)
    for ax in axes[1:]:
        ax.set_xticks(list(at), names, rotation=20, ha="right", fontsize=8)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    return _save(plt, fig, title, path)


def legend_name(name: str) -> str:
    """A server's name as plots show it: bf16 for the baseline ("auto")."""
    return name.replace("auto", "bf16", 1) if name.startswith("auto") else name


def series(r: dict) -> str:
    """A server's name in tables and plots: its dtype, and "explicit" where --max-running-requests was passed."""
    return r["kv_cache_dtype"] + (" explicit" if r.get("flags", "explicit") == "explicit" else "")


def table(report: dict) -> str:
    """One markdown row per run: the load generator's numbers beside the server's."""
    capacity = {(s["regime"], series(s)): (s.get("capacity_tokens", s.get("refused", "-")),
                                           s.get("max_running_requests", "-")) for s in report["servers"]}
    lines = ["| regime | workload | kv dtype | capacity tok | max running | conc. | out tok/s | x bf16 | p99 TTFT ms | "
             "p99 ITL ms | peak running | retracted | cached (loadgen) | specache B/step, hit, recall |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        m, s, sc = r["loadgen"], r["server"], r.get("specache")
        hit = m.get("cache_report", {}).get("cache_hit_rate_pct")
        spec = (f"{sc['prefetched_bytes_per_step']:,.0f}, {_pct(sc['spec_token_hit_rate'])}, {_pct(sc['recall'])}"
                if sc else "")
        tokens, running = capacity.get((r["regime"], series(r)), ("-", "-"))
        lines.append(f"| {r['regime']} | {r['workload']} | {series(r)} | {tokens} | {running} | {r['concurrency']} | "
                     f"{m.get('output_throughput', float('nan')):.1f} | "
                     f"{r.get('output_throughput_vs_bf16', float('nan')):.2f} | "
                     f"{m.get('p99_ttft_ms', float('nan')):.0f} | {m.get('p99_itl_ms', float('nan')):.0f} | "
                     f"{s['peak_running_requests']} | {s['retracted_requests']} | "
                     f"{'-' if hit is None else f'{hit:.0f}%'} | {spec} |")
    return "\n".join(lines)


def _pct(x) -> str:
    return "-" if x is None else f"{x:.0%}"
