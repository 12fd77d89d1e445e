"""`sgl-kvq bench capacity` end to end on the tiny model: bf16 and kivi2 at one pinned budget, each server given a
burst of requests sent at once; the JSON holds each dtype's capacity, max_running_requests and the peak of running
requests its scheduler logged during the burst."""

from __future__ import annotations

import json
import subprocess

import pytest
from slices import matrix_only

pytestmark = [pytest.mark.slow, pytest.mark.engine,
              matrix_only("a measurement-style run of `sgl-kvq bench capacity` (251 s); "
                          "its helpers are tests/tools/'s")]


def test_bench_capacity_records_the_peak_of_running_requests_of_a_burst(venv_bin, tmp_path):
    out = tmp_path / "capacity-tiny.json"
    cmd = [str(venv_bin / "sgl-kvq"), "bench", "capacity", "--model", "tiny", "--kv-cache-dtype", "auto,kivi2",
           "--mem-fraction-static", "", "--kv-cache-gb", "0.004", "--burst", "6", "--burst-prompt-tokens", "80",
           "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "peak running (burst)" in proc.stdout
    rows = {r["kv_cache_dtype"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(rows) == {"auto", "kivi2"}
    for dtype, r in rows.items():
        assert r["capacity_tokens"] > 6 * 84 and r["max_running_requests"] >= 6, r
        # all six fit: they ran together (more than one at a time), and never more than were sent
        assert r["burst_requests"] == 6 and 2 <= r["peak_running_requests"] <= 6, (dtype, r)
