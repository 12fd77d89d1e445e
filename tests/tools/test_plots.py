"""Every benchmark plot is readable: each axes shows data, has a legend naming each of its lines, and x/y labels with
units; no axes is left empty. Rendered with the Agg backend on small results shaped like the committed JSONs (and on
the committed capacity-sweep-formats JSON, whose plot once had no legend and an empty panel). No server starts."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

from bench import plots  # noqa: E402
from bench.commands import bench_capacity, bench_decode, bench_soak, serving_stats  # noqa: E402
from bench.decision import cells as decision_cells  # noqa: E402
from bench.decision import plot as decision_plot  # noqa: E402

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"
UNIT = re.compile(r"\(.+\)")  # "context (tokens)", "decode step (ms)", "tokens per GiB of budget (x bf16's)"


def readable(fig, series: set[str], axes: int) -> None:
    """`axes` axes, each with a finite data point, a legend with one entry per line (every line labelled, `series`
    among them), and x and y labels that name a unit."""
    assert fig is not None
    assert len(fig.axes) == axes, [ax.get_title() for ax in fig.axes]
    for ax in fig.axes:
        where = ax.get_title() or "axes"
        points = [(x, y) for line in ax.get_lines() for x, y in zip(line.get_xdata(), line.get_ydata())
                  if math.isfinite(float(x)) and math.isfinite(float(y))]
        assert ax.has_data() and points, f"{where}: no data"
        legend = ax.get_legend()
        assert legend is not None, f"{where}: no legend"
        texts = [t.get_text() for t in legend.get_texts()]
        labels = [line.get_label() for line in ax.get_lines()]
        assert not [x for x in labels if x.startswith("_")], f"{where}: a line without a name in {labels}"
        assert len(set(labels)) == len(labels), f"{where}: two lines named alike in {labels}"
        assert sorted(texts) == sorted(labels), f"{where}: legend {texts}, lines {labels}"
        assert series <= set(texts), f"{where}: legend {texts} misses {series - set(texts)}"
        for which, label in (("x", ax.get_xlabel()), ("y", ax.get_ylabel())):
            assert label.strip(), f"{where}: no {which} label"
            assert UNIT.search(label), f"{where}: {which} label {label!r} names no unit"


def xticks(ax) -> list[str]:
    fig = ax.figure
    fig.canvas.draw()  # tick labels are laid out at draw time
    lo, hi = sorted(ax.get_xlim())
    return [t.get_text() for t, v in zip(ax.get_xticklabels(), ax.get_xticks()) if lo <= v <= hi]


def test_readable_rejects_the_old_capacity_figure():
    """The checker catches what capacity-sweep-formats-smollm2.png had: an axes without a legend, and an empty one."""
    fig, axes = plots.pyplot().subplots(1, 2)
    axes[0].plot([0.25, 1], [5, 5], label="kivi2")
    for ax in axes:
        ax.set(xlabel="KV budget (GiB)", ylabel="tokens (x bf16's)")
    with pytest.raises(AssertionError, match="no legend"):
        readable(fig, {"kivi2"}, axes=2)
    axes[0].legend()
    with pytest.raises(AssertionError, match="no data"):
        readable(fig, {"kivi2"}, axes=2)
    plots.pyplot().close(fig)


def test_replot_script_draws_every_committed_png():
    """scripts/replot_results.py knows how to redraw each PNG under bench/results/ from its JSON (and each JSON it
    reads is committed), so a plot fix reaches every committed figure without rerunning a benchmark."""
    script = RESULTS.parents[1] / "scripts" / "replot_results.py"
    spec = importlib.util.spec_from_file_location("replot_results", script)
    replot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replot)
    pngs = {str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*.png")}
    assert pngs == set(replot.PLOTS), f"no redraw for {pngs - set(replot.PLOTS)}; gone: {set(replot.PLOTS) - pngs}"


# --- bench capacity ---------------------------------------------------------------------------------------------

def capacity_rows(kinds=("mem_fraction_static", "kv_cache_gb")) -> list[dict]:
    rows = []
    for kind, values in (("mem_fraction_static", (0.03, 0.1)), ("kv_cache_gb", (0.5, 2.0))):
        if kind not in kinds:
            continue
        for value in values:
            budget = {kind: value}
            gib = value if kind == "kv_cache_gb" else value * 10
            for dtype, per_gib in (("auto", 1000), ("kivi2", 6000), ("kivi4", 3400)):
                rows.append({"kv_cache_dtype": dtype, "budget": budget, "budget_label": bench_capacity.label(budget),
                             "kv_budget_bytes": int(gib * 2**30), "capacity_tokens": int(per_gib * gib)})
            rows.append({"kv_cache_dtype": "fp8_e4m3", "budget": budget, "budget_label": bench_capacity.label(budget),
                         "refused": "CPU FP8 KV cache requires Intel AMX support."})
    bench_capacity.ratios(rows)
    return rows


def test_capacity_plot_both_budget_kinds(tmp_path):
    fig = bench_capacity.plot(capacity_rows(), tmp_path / "c.png")
    readable(fig, {"bf16", "kivi2", "kivi4"}, axes=2)
    assert (tmp_path / "c.png").stat().st_size > 0
    assert xticks(fig.axes[1]) == ["0.5", "2"]  # the pinned budgets themselves


def test_capacity_plot_draws_no_panel_for_a_kind_without_rows(tmp_path):
    fig = bench_capacity.plot(capacity_rows(kinds=("mem_fraction_static",)), tmp_path / "c.png")
    readable(fig, {"bf16", "kivi2", "kivi4"}, axes=1)
    assert fig.axes[0].get_title().startswith("SGLang's default sizing")


def test_capacity_plot_of_the_committed_formats_sweep(tmp_path):
    """The plot that had no legend and an empty right panel: its JSON has default-sizing rows only."""
    rows = json.loads((RESULTS / "capacity-sweep-formats-smollm2.json").read_text())["runs"]
    fig = bench_capacity.plot(rows, tmp_path / "c.png")
    readable(fig, {"bf16", "gear2", "gearl2", "logquant2", "zipcache2"}, axes=1)


def test_capacity_plot_without_capacities_writes_nothing(tmp_path):
    rows = [{"kv_cache_dtype": "fp8_e4m3", "budget": {"kv_cache_gb": 1}, "budget_label": "x", "refused": "no"}]
    assert bench_capacity.plot(rows, tmp_path / "c.png") is None
    assert not (tmp_path / "c.png").exists()


# --- bench decode -----------------------------------------------------------------------------------------------

def decode_rows(dtypes=("auto", "kivi2", "specache2"), batches=(1, 8)) -> list[dict]:
    rows = [{"kv_cache_dtype": d, "batch": b, "context": c, "ms_per_step": ms * c / 1024 * b,
             "cpu_ms_per_step": ms, "tok_per_s": 1000 * b / (ms * c / 1024 * b), "kv_read_bytes_per_step": c * b}
            for d, ms in (("auto", 60.0), ("kivi2", 40.0), ("specache2", 70.0), ("kivi2@/tmp/old-tree", 50.0))
            if d in dtypes for b in batches for c in (1024, 2048, 4096)]
    bench_decode.ratios(rows)
    return rows


def test_decode_plot(tmp_path):
    fig = bench_decode.plot(decode_rows(), tmp_path / "d.png")
    readable(fig, {"bf16", "kivi2", "specache2"}, axes=4)
    assert (tmp_path / "d.png").stat().st_size > 0
    assert all(xticks(ax) == ["1024", "2048", "4096"] for ax in fig.axes)  # the contexts run, not 2^10


def test_decode_plot_merges_runs_and_drops_a_ratio_panel_without_ratios(tmp_path):
    """Several JSONs' rows in one plot (as docs/results.md's 1k-16k plots): a batch whose run had no bf16 server has
    no ratio to bf16, so no ratio axes, rather than an empty one."""
    rows = decode_rows(batches=(1,)) + decode_rows(dtypes=("kivi2", "kivi2@/tmp/old-tree"), batches=(8,))
    fig = bench_decode.plot(rows, tmp_path / "d.png")
    readable(fig, {"kivi2"}, axes=3)
    assert not any(ax.get_title() == "batch 8: output tok/s / bf16's (same run)" for ax in fig.axes)


def test_decode_plot_single_context_point(tmp_path):
    """decode-speed-1thread's shape: one context, a tree-labelled series beside the dtypes."""
    rows = [r for r in decode_rows(dtypes=("auto", "kivi2", "kivi2@/tmp/old-tree")) if r["context"] == 1024]
    readable(bench_decode.plot(rows, tmp_path / "d.png"), {"bf16", "kivi2", "kivi2@/tmp/old-tree"}, axes=4)


# --- bench serving ----------------------------------------------------------------------------------------------

def serving_runs(itl=True) -> list[dict]:
    runs = []
    for regime in ("tight", "generous"):
        for dtype, speed in (("auto", 1.0), ("kivi2", 1.6), ("kivi4", 1.3)):
            for c in (4, 16):
                loadgen = {"output_throughput": 10 * c ** 0.5 * speed, "p99_ttft_ms": 100.0 * c / speed,
                           "p99_itl_ms": 50.0 / speed if itl else None}
                runs.append({"regime": regime, "kv_cache_dtype": dtype, "workload": "sharegpt", "concurrency": c,
                             "loadgen": loadgen})
    runs.append({"regime": "tight", "kv_cache_dtype": "specache2", "workload": "sharegpt", "concurrency": 4,
                 "loadgen": {}, "error": "refused"})  # a server that did not start: no line
    return runs


def test_serving_plot(tmp_path):
    fig = serving_stats.plot(serving_runs(), "sharegpt", "tight", "t", tmp_path / "s.png")
    readable(fig, {"bf16 explicit", "kivi2 explicit", "kivi4 explicit"}, axes=3)
    assert (tmp_path / "s.png").stat().st_size > 0


def test_serving_plot_drops_a_number_no_run_reported(tmp_path):
    fig = serving_stats.plot(serving_runs(itl=False), "sharegpt", "generous", "t", tmp_path / "s.png")
    readable(fig, {"bf16 explicit", "kivi2 explicit"}, axes=2)
    assert [ax.get_ylabel() for ax in fig.axes] == ["output throughput (tok/s)", "p99 TTFT (ms)"]


def test_serving_budget_plot(tmp_path):
    runs = [dict(r, flags="default", kv_cache_gb=gb, concurrency=16, server={"peak_running_requests": 4 * i + 4})
            for i, gb in enumerate((0.12, 0.5)) for r in serving_runs()
            if r["concurrency"] == 4 and r["regime"] == "tight" and r["loadgen"]]
    fig = serving_stats.plot_budgets(runs, "sharegpt", 16, "t", tmp_path / "b.png")
    readable(fig, {"bf16", "kivi2"}, axes=2)
    assert serving_stats.plot_budgets(runs, "sharegpt", 8, "t", tmp_path / "none.png") is None


def test_serving_plot_of_flags_default_runs(tmp_path):
    runs = [dict(r, flags="default") for r in serving_runs()]
    readable(serving_stats.plot(runs, "sharegpt", "tight", "t", tmp_path / "s.png"), {"bf16", "kivi2"}, axes=3)


def test_serving_plot_without_results_writes_nothing(tmp_path):
    assert serving_stats.plot(serving_runs(), "shared-prefix-multiturn", "tight", "t", tmp_path / "s.png") is None
    assert not (tmp_path / "s.png").exists()


# --- bench soak -------------------------------------------------------------------------------------------------

def test_soak_plot(tmp_path):
    rows = [{"dtype": d, "mode": m, "rss_curve": [[2.0 * i, (base + 4 * i) * 2**20] for i in range(10)]}
            for d, m, base in (("kivi2", "deterministic", 3400), ("kivi2", "default", 3380), ("auto", "default", 2550))]
    rows.append({"dtype": "specache2", "mode": "default", "rss_curve": []})  # died before the first sample
    fig = bench_soak.plot(rows, tmp_path / "s.png")
    readable(fig, {"kivi2 deterministic", "kivi2 default", "bf16 default"}, axes=1)
    assert (tmp_path / "s.png").stat().st_size > 0


# --- bench decision ---------------------------------------------------------------------------------------------

def decision_table(ppl: dict[str, float], attn: dict[str, float]) -> decision_cells.Table:
    """The decision table with only these ppl deltas (%) and attention errors measured."""
    table = decision_cells.collect([])
    for row in table.rows:
        for column, values in (("ppl_delta", ppl), ("attn", attn)):
            if row.dtype in values:
                row.cells[column] = decision_cells.Cell(values[row.dtype], f"{values[row.dtype]}", "x.json")
    return table


def test_decision_plot(tmp_path):
    table = decision_table({"bf16": 0.0, "kivi4": 0.3, "kivi2": 33.0, "peer_int4": 1.2},
                           {"bf16": 0.0, "kivi4": 0.11, "peer_int4": 0.15, "peer_tq3": 0.33, "kivi3": 0.23})
    fig = decision_plot.plot(table, tmp_path / "d.png")
    readable(fig, {"bf16", "kivi4", "peer_int4", decision_plot.FRONT}, axes=2)
    assert (tmp_path / "d.png").stat().st_size > 0
    lines = {line.get_label(): line for line in fig.axes[1].get_lines()}
    assert lines["kivi3"].get_marker() != lines["peer_tq3"].get_marker()  # ours and the peers' tell apart
    front = lines[decision_plot.FRONT]
    assert list(front.get_xdata()) == [4860, 5040, 6480, 23040]  # peer_tq3, kivi3, kivi4, bf16; not peer_int4
    names = {t.get_text() for t in fig.axes[1].texts}
    assert set(lines) - {decision_plot.FRONT} <= names  # each point labelled with its dtype
    assert any(t.startswith("not measured: ") and "specache1" in t for t in names)


def test_decision_plot_drops_a_panel_without_points(tmp_path):
    fig = decision_plot.plot(decision_table({}, {"bf16": 0.0, "kivi2": 0.59}), tmp_path / "d.png")
    readable(fig, {"bf16", "kivi2", decision_plot.FRONT}, axes=1)
    assert fig.axes[0].get_ylabel().startswith("attention output error")


def test_decision_plot_without_quality_numbers_writes_nothing(tmp_path):
    assert decision_plot.plot(decision_table({}, {}), tmp_path / "d.png") is None
    assert not (tmp_path / "d.png").exists()


# --- bench/kernels.py -------------------------------------------------------------------------------------------

def test_kernel_times_plot_removes_a_model_x_batch_not_run():
    rows = [{"model": m, "batch": b, "context": c, "variant": v, "us": 10.0 * c / 1024 * b}
            for m, batches in (("llama3-8b", (1, 8)), ("smollm2", (1,)))
            for b in batches for c in (1024, 4096) for v in ("kvq2", "sglang-triton", "torch-sdpa")]
    fig = plots.kernel_times(rows)
    readable(fig, {"kvq2", "sglang-triton", "torch-sdpa"}, axes=3)
    plots.pyplot().close(fig)
