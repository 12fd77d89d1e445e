"""The decision figure: quality against KV bytes per token, one point per dtype, the Pareto front drawn through the
dtypes no other beats on both. One panel per quality measure that has points (ppl vs bf16, attention error)."""

from __future__ import annotations

import textwrap

from bench.decision.cells import BF16, Table
from bench.decision.front import fronts

FRONT = "Pareto front (fewer bytes and lower error; no host copy)"
PANELS = (  # column, title, y label, y scale
    ("ppl_delta", "perplexity over cached turns (engine), against bf16 in the same run", "ppl vs bf16 (%)",
     {"value": "symlog", "linthresh": 1.0}),
    ("attn", "attention output error (offline, {model}'s real Q/K/V)",
     "attention output error (||O - O_fp16|| / ||O_fp16||)", {"value": "linear"}),
)
MARKERS = {"ours": ("o", True), "recipe": ("D", True), "peer": ("s", False), BF16: ("*", True)}  # marker, filled


def _colors(plt, dtypes: list[str], groups: dict[str, str]) -> dict[str, tuple]:
    """One color per dtype, the same in every panel: ours from tab10, the recipes' from Set1 (their diamonds never
    share a kivi width's color), the peers' from Dark2 (never a pale shade)."""
    cycles = {"ours": iter(plt.get_cmap("tab10").colors * 2), "recipe": iter(plt.get_cmap("Set1").colors * 2),
              "peer": iter(plt.get_cmap("Dark2").colors * 2)}
    return {d: "black" if groups[d] == BF16 else next(cycles[groups[d]]) for d in dtypes}


LABEL_POINTS = 7  # font size of the point names
OFFSETS = ((6, 4, "left"), (-6, 4, "right"), (6, -11, "left"), (-6, -11, "right"), (6, 14, "left"),
           (-6, 14, "right"))  # where a name may sit from its point (points), tried in order


def _annotate(ax, points: dict[str, tuple[float, float]]) -> None:
    """Each point's name beside it, at the first offset whose text box overlaps no name placed before (the 4-bit
    formats share 6,480 B); call once the axes' scales and limits are set."""
    fig = ax.figure
    scale = fig.dpi / 72  # pixels per point
    placed: list[tuple[float, float, float, float]] = []

    def box(name, x, y, dx, dy, ha):
        px, py = ax.transData.transform((x, y))
        w, h = 0.62 * LABEL_POINTS * len(name) * scale, LABEL_POINTS * scale
        x0 = px + dx * scale - (w if ha == "right" else 0)
        return x0, py + dy * scale, x0 + w, py + dy * scale + h

    def free(b):
        return not any(b[0] < o[2] and o[0] < b[2] and b[1] < o[3] and o[1] < b[3] for o in placed)

    for name, (x, y) in sorted(points.items(), key=lambda kv: (kv[1][1], kv[0])):
        dx, dy, ha = next((o for o in OFFSETS if free(box(name, x, y, *o))), OFFSETS[0])
        placed.append(box(name, x, y, dx, dy, ha))
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(dx, dy), fontsize=LABEL_POINTS, ha=ha)


def plot(table: Table, path):
    """Writes `path` and returns the Figure; None (nothing written) where no dtype has a quality number."""
    import matplotlib.ticker

    from bench.plots import pyplot

    plt = pyplot()
    groups = {r.dtype: r.group for r in table.rows}
    colors = _colors(plt, [r.dtype for r in table.rows], groups)
    panels = []
    on_front = fronts(table)
    for column, title, ylabel, yscale in PANELS:
        points = {r.dtype: (r.cell("bytes").value, r.cell(column).value) for r in table.rows
                  if not r.cell(column).missing}
        if points:
            missing = [r.dtype for r in table.rows if r.cell(column).missing]
            panels.append((column, title.format(model=table.model.title), ylabel, yscale, points, missing))
    if not panels:
        return None
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 4.8 * len(panels)), squeeze=False)
    for ax, (column, title, ylabel, yscale, points, missing) in zip(axes[:, 0], panels):
        order = [r.dtype for r in table.rows]
        for dtype in sorted(points, key=order.index):
            marker, filled = MARKERS[groups[dtype]]
            ax.plot(*zip(points[dtype]), linestyle="", marker=marker, markersize=11 if dtype == BF16 else 8,
                    color=colors[dtype], markerfacecolor=colors[dtype] if filled else "white", markeredgewidth=1.5,
                    label=dtype)
        front = on_front[column]
        ax.plot([points[d][0] for d in front], [points[d][1] for d in front], drawstyle="steps-post",
                linestyle="--", color="gray", zorder=0, label=FRONT)
        ax.set_xscale("log")
        ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}"))
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_yscale(**yscale)
        if yscale["value"] == "symlog":  # plain numbers, and no empty band of negatives below 0
            ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            ax.set_ylim(bottom=min(-0.5, 1.5 * min(y for _, y in points.values())))
        ax.set_xlabel(f"KV cache bytes per token (B, all {table.model.shape.layers} layers of {table.model.title})")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        _annotate(ax, points)
        ax.legend(title="dtype (● ours, ◆ ours from a recipe, □ peers, ★ bf16)", fontsize=7, title_fontsize=8,
                  loc="upper left", bbox_to_anchor=(1.01, 1))
        if missing:
            note = "\n".join(textwrap.wrap("not measured: " + ", ".join(missing), 110))
            ax.text(0.0, -0.2, note, transform=ax.transAxes, fontsize=7, va="top")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig
