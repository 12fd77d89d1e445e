"""The Pareto front of (bytes per token, error): the dtypes no other dtype beats on both, fewer or as many bytes and
as low or lower error, with one of the two strictly lower."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bench.decision.cells import Table

QUALITY = {"ppl_delta": "ppl", "attn": "attention"}  # the plot's panels: the error each front is drawn on


def pareto_front(points: dict[str, tuple[float, float]]) -> list[str]:
    """The names of the points on the front, by bytes ascending (error then descends)."""
    def beaten(name: str) -> bool:
        x, y = points[name]
        return any(ox <= x and oy <= y and (ox, oy) != (x, y) for other, (ox, oy) in points.items() if other != name)

    return sorted((n for n in points if not beaten(n)), key=lambda n: (points[n][0], points[n][1], n))


def fronts(table: Table) -> dict[str, list[str]]:
    """Per quality column, the dtypes on the front of (device bytes per token, that error) among those measured that
    keep no host copy: SpeCache also keeps every token in 16 bits in host RAM, which its device bytes do not count,
    so it is shown beside the front (README, docs/decision.md, the plot) and never on it."""
    from bench.decision.cells import host_bytes

    hosted = {r.dtype for r in table.rows if host_bytes(r.dtype, table.model)}
    out = {}
    for column in QUALITY:
        points = {r.dtype: (r.cell("bytes").value, r.cell(column).value) for r in table.rows
                  if r.dtype not in hosted and not r.cell(column).missing}
        out[column] = pareto_front(points)
    return out
