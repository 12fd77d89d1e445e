"""The soak's resident-memory summary (bench/soak.py rss_growth): warm-up excluded, growth and the slope over
the rest of the run, on synthetic curves whose answer is known."""

from __future__ import annotations

import pytest

from bench.soak import rss_growth

MIB = 2 ** 20


def test_a_warm_up_jump_then_a_flat_curve_has_no_slope():
    curve = [(t, (3000 + (200 if t >= 40 else 0)) * MIB) for t in range(0, 1801, 2)]
    r = rss_growth(curve)
    assert r["growth_mib"] == 0 and r["slope_mib_per_hour"] == 0 and r["after_warmup_mib"] == 3200


def test_a_steady_leak_shows_as_its_rate():
    # 10 MiB every 10 minutes after a warm-up plateau: 60 MiB an hour, whatever the run's length
    curve = [(t, 3000 * MIB + int(t * 10 * MIB / 600)) for t in range(0, 1801, 2)]
    r = rss_growth(curve)
    assert r["slope_mib_per_hour"] == pytest.approx(60, abs=0.1)
    assert r["growth_mib"] == pytest.approx(22.5, abs=0.1)  # the last three quarters: 1,350 s at 1 MiB / min


def test_noise_around_a_level_averages_out():
    curve = [(t, (3000 + (4 if (t // 2) % 2 else -4)) * MIB) for t in range(0, 1801, 2)]
    assert abs(rss_growth(curve)["slope_mib_per_hour"]) < 1


def test_too_short_a_curve_reports_nothing():
    assert rss_growth([(0.0, MIB)])["slope_mib_per_hour"] is None


def test_each_server_process_is_named_by_its_role():
    from bench.soak import process_role

    assert process_role(["sglang::scheduler_TP0"]) == "scheduler_TP0"
    assert process_role(["sglang::detokenizer"]) == "detokenizer"
    # untitled children are not the launcher (which rss_by_process names by its pid)
    assert process_role(["/venv/bin/python", "-c", "from multiprocessing.resource_tracker import main"]) == "other"
    assert process_role([]) == "other"  # a zombie's empty command line


def test_the_server_total_is_the_sum_of_its_processes():
    import os

    from bench.soak import rss_by_process, rss_bytes

    roles = rss_by_process(os.getpid())  # this pytest process stands for the launcher
    assert roles["tokenizer_manager"] > 0
    assert rss_bytes(os.getpid()) >= roles["tokenizer_manager"]
    assert rss_by_process(2 ** 22 + 12345) == {}  # gone: nothing, not an error
