"""Which parameters of a matrix test CI runs. The engine tests that compare kvq_triton (the Triton interpreter on a
CPU: 1-3 minutes an engine) with kvq_torch, or repeat one check per dtype, run one representative case per format
in CI, chosen to cover the most code; KVQ_TEST_MATRIX=all runs every case (the matrix a format change should run)."""

from __future__ import annotations

import os


def ci_slice(every: list, ci: list) -> list:
    """`ci` (a sublist of `every`) unless KVQ_TEST_MATRIX=all."""
    assert all(case in every for case in ci), (ci, every)
    return list(every) if full_matrix() else list(ci)


def full_matrix() -> bool:
    """True under KVQ_TEST_MATRIX=all: the tests that repeat in CI what a cheaper case covers run too."""
    return os.environ.get("KVQ_TEST_MATRIX") == "all"


def matrix_only(why: str):
    """A skip mark for an engine test CI leaves to the matrix (KVQ_TEST_MATRIX=all); `why`: what covers it in CI."""
    import pytest

    return pytest.mark.skipif(not full_matrix(), reason=f"KVQ_TEST_MATRIX=all runs it; in CI {why}")


def covering_pairs(xs: list, ys: list) -> list[tuple]:
    """Every (x, y) under KVQ_TEST_MATRIX=all; in CI each x once, with the ys in turn (x_i, y_{i mod len(ys)}), so
    every x and every y still runs. For the kernel sweeps, whose time under the Triton interpreter is linear in their
    cases: a shape bug shows in either dtype, and a dtype bug on any shape."""
    if full_matrix():
        return [(x, y) for x in xs for y in ys]
    return [(x, ys[i % len(ys)]) for i, x in enumerate(xs)]
