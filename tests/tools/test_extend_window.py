"""bench/extend_window.py (docs/long-context.md quotes it): it runs, both sliding ways agree (it checks), and its
JSON has a row per context."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "extend_window.py"


def test_extend_window_runs_and_writes_a_row_per_context(tmp_path):
    spec = importlib.util.spec_from_file_location("extend_window", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "ew.json"
    assert mod.main(["--context", "1024", "1536", "--reps", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert [r["context"] for r in res["rows"]] == [1024, 1536]
    for r in res["rows"]:
        assert set(r["ms"]) == {"sliding, every page read", "sliding, the window's pages read", "full attention"}
        assert all(v > 0 for v in r["ms"].values()) and r["sliding_speedup"] > 0
