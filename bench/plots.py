"""What every benchmark plot shares: the Agg backend and finite points only. Every figure has a legend naming each line
on every axes, axis labels with units, and no axes without data (tests/tools/test_plots.py). The figures stay beside
their benchmarks (`bench_capacity.plot`, `bench_decode.plot`, `bench_soak.plot`, `serving_stats.plot`,
`bench.decision.plot.plot`), except the kernel benchmark's, here: bench/kernels.py imports torch and triton when
loaded."""

from __future__ import annotations

import math


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display; the benchmarks write PNGs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def finite(pts):
    """The (x, y, ...) points whose every coordinate is a finite number, sorted: a missing value (None, NaN) is no
    point, not a gap a line is drawn across."""
    return sorted(p for p in pts if all(isinstance(v, (int, float)) and math.isfinite(v) for v in p))


def ticks_at(ax, values) -> None:
    """Major x ticks at the values the points were measured at, written plainly (1024, 0.25): on a log axis the
    default ticks are powers (2^10) or miss the data (a 0.25-4 GiB sweep showed only 0.5, 1, 2)."""
    import matplotlib.ticker

    values = sorted(set(values))
    ax.set_xticks(values, [f"{v:g}" for v in values])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())


def kernel_times(rows):
    """bench/kernels.py's figure: kernel time against context, one axes per model x batch, one line per variant."""
    plt = pyplot()
    models = sorted({r["model"] for r in rows})
    batches = sorted({r["batch"] for r in rows})
    variants = sorted({r["variant"] for r in rows})
    fig, axes = plt.subplots(len(models), len(batches), figsize=(4 * len(batches), 3.2 * len(models)), squeeze=False)
    for i, m in enumerate(models):
        for j, b in enumerate(batches):
            ax = axes[i][j]
            for v in variants:
                pts = finite((r["context"], r["us"]) for r in rows
                             if (r["model"], r["batch"], r["variant"]) == (m, b, v))
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=v)
            if not ax.get_lines():  # this model was not run at this batch
                fig.delaxes(ax)
                continue
            ax.set(title=f"{m}, batch {b}", xscale="log", yscale="log", xlabel="context (tokens)",
                   ylabel="kernel time (µs)")
            ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
