"""The Pareto front of (bytes per token, error): the dtypes no other dtype beats on both, fewer or as many bytes and
as low or lower error, with one of the two strictly lower."""

from __future__ import annotations


def pareto_front(points: dict[str, tuple[float, float]]) -> list[str]:
    """The names of the points on the front, by bytes ascending (error then descends)."""
    def beaten(name: str) -> bool:
        x, y = points[name]
        return any(ox <= x and oy <= y and (ox, oy) != (x, y) for other, (ox, oy) in points.items() if other != name)

    return sorted((n for n in points if not beaten(n)), key=lambda n: (points[n][0], points[n][1], n))
