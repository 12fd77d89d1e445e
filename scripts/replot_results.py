"""Redraw every committed PNG under bench/results/ from the committed JSON it was drawn from, with the benchmarks'
own plot functions (no benchmark is rerun).

    .venv/bin/python scripts/replot_results.py          # every PNG below
    .venv/bin/python scripts/replot_results.py decode    # those whose name contains "decode"

Most PNGs are what the bench command wrote beside its JSON; the decode plots named after a context range are
`bench_decode.plot` over several runs' rows (docs/results.md says which). decode-1k-16k-smollm2.png is the earlier
machine's sweep, whose JSON was overwritten by a later run of the same command: its rows are read from the commit
that drew the plot (0fb18af).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.commands import bench_capacity, bench_decision, bench_decode, bench_soak, serving_stats  # noqa: E402
from bench.decision import plot as decision_plot  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def load(name: str, commit: str | None = None) -> dict:
    if commit is None:
        return json.loads((RESULTS / name).read_text())
    text = subprocess.run(["git", "show", f"{commit}:bench/results/{name}"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout
    return json.loads(text)


def decode(*sources) -> callable:
    """bench_decode.plot over the rows of these JSONs (a name, or (name, commit))."""
    def draw(path):
        rows = []
        for s in sources:
            rows += load(*((s,) if isinstance(s, str) else s))["runs"]
        return bench_decode.plot(rows, path)
    return draw


def capacity(name: str) -> callable:
    return lambda path: bench_capacity.plot(load(name)["runs"], path)


def serving(name: str, workload: str, regime: str) -> callable:
    def draw(path):
        report = load(name)
        gb = report["regimes"][regime]["kv_cache_gb"]
        return serving_stats.plot(report["runs"], workload, regime,
                                  f"{report['model']}: {workload}, {regime} KV budget ({gb:.3f} GiB per server)", path)
    return draw


def serving_turns(name: str, workload: str, regime: str, concurrency: int) -> callable:
    def draw(path):
        report = load(name)
        gb = report["regimes"][regime]["kv_cache_gb"]
        return serving_stats.plot_turns(report["runs"], workload, regime, concurrency,
                                        f"{report['model']}: {workload}, {regime} KV budget ({gb:.3f} GiB per "
                                        f"server), concurrency {concurrency}", path)
    return draw


def serving_budgets(*names: str) -> callable:
    """serving_stats.plot_budgets over the runs of several `bench serving` reports (one per pair of budgets)."""
    def draw(path):
        runs = [r for name in names for r in load(name)["runs"]]
        model = load(names[0])["model"]
        return serving_stats.plot_budgets(runs, "shared-prefix-multiturn", 16,
                                          f"{model}: shared-prefix multi-turn, concurrency 16, default flags", path)
    return draw


def decision(model: str):
    """`model`'s decision figure from every committed result file, as `sgl-kvq bench decision` draws it."""
    from bench.decision.models import MODELS

    return lambda path: decision_plot.plot(bench_decision.build(bench_decision.input_paths(None), MODELS[model]),
                                           path)


PLOTS = {  # PNG under bench/results/: how it is drawn
    "capacity-sweep-smollm2.png": capacity("capacity-sweep-smollm2.json"),
    "capacity-sweep-formats-smollm2.png": capacity("capacity-sweep-formats-smollm2.json"),
    "decode-smollm2.png": decode("decode-smollm2.json"),
    "decode-speed-1thread-smollm2.png": decode("decode-speed-1thread-smollm2.json"),
    "decode-sweep-smollm2.png": decode("decode-sweep-smollm2.json"),
    "decode-1k-8k-kernel-smollm2.png": decode("decode-sweep-smollm2.json", "decode-b8-long-smollm2.json"),
    "decode-sweep-torch-paths-smollm2.png": decode("decode-sweep-torch-paths-smollm2.json"),
    "decode-1k-8k-smollm2.png": decode("decode-sweep-torch-paths-smollm2.json",
                                       "decode-b8-long-torch-paths-smollm2.json"),
    "decode-1k-16k-b8-smollm2.png": decode("decode-sweep-torch-paths-smollm2.json",
                                           "decode-b8-long-torch-paths-smollm2.json", "decode-b8-16k-smollm2.json"),
    "decode-1k-16k-smollm2.png": decode(("decode-sweep-smollm2.json", "0fb18af"), "decode-16k-smollm2.json"),
    "decode-long-gemma3.png": decode("decode-long-gemma3.json"),
    "serving-smollm2-shared-prefix-multiturn-tight.png": serving("serving-smollm2.json", "shared-prefix-multiturn",
                                                                 "tight"),
    "serving-smollm2-shared-prefix-multiturn-generous.png": serving("serving-smollm2.json", "shared-prefix-multiturn",
                                                                    "generous"),
    "serving-sharegpt-smollm2-sharegpt-tight.png": serving("serving-sharegpt-smollm2.json", "sharegpt", "tight"),
    "serving-sharegpt-smollm2-sharegpt-generous.png": serving("serving-sharegpt-smollm2.json", "sharegpt", "generous"),
    "serving-long-prompts-smollm2-shared-prefix-multiturn-tight.png": serving(
        "serving-long-prompts-smollm2.json", "shared-prefix-multiturn", "tight"),
    "serving-long-prompts-torch-paths-smollm2-shared-prefix-multiturn-tight.png": serving(
        "serving-long-prompts-torch-paths-smollm2.json", "shared-prefix-multiturn", "tight"),
    "serving-concurrency-smollm2-shared-prefix-multiturn-tight.png": serving(
        "serving-concurrency-smollm2.json", "shared-prefix-multiturn", "tight"),
    "serving-recipes-smollm2-shared-prefix-multiturn-tight.png": serving(
        "serving-recipes-smollm2.json", "shared-prefix-multiturn", "tight"),
    "serving-agentic-smollm2-agentic-tight-c4-turns.png": serving_turns("serving-agentic-smollm2.json", "agentic",
                                                                         "tight", 4),
    "serving-agentic-gemma3-agentic-tight-c4-turns.png": serving_turns("serving-agentic-gemma3.json", "agentic",
                                                                        "tight", 4),
    "serving-default-budgets-smollm2.png": serving_budgets("serving-default-0.12-2-smollm2.json",
                                                           "serving-default-0.25-0.5-smollm2.json"),
    "serving-default-1-smollm2.png": serving("serving-default-1-smollm2.json", "shared-prefix-multiturn", "generous"),
    "serving-rotation-smollm2-shared-prefix-multiturn-generous.png": serving(
        "serving-rotation-smollm2.json", "shared-prefix-multiturn", "generous"),
    "soak-smollm2.png": lambda path: bench_soak.plot(load("soak-smollm2.json")["runs"], path),
    "soak-30min-smollm2.png": lambda path: bench_soak.plot(load("soak-30min-smollm2.json")["runs"], path),
    "decision-smollm2.png": decision("smollm2"),
    "decision-gemma3.png": decision("gemma3"),
}


def main(argv: list[str]) -> int:
    for png, draw in PLOTS.items():
        if argv and not any(a in png for a in argv):
            continue
        fig = draw(RESULTS / png)
        print(f"{png}: {'no data, not written' if fig is None else f'{len(fig.axes)} axes'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
