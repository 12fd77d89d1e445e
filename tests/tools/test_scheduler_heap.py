"""bench/scheduler_heap.py reads a live process's Python objects and torch tensors through gdb: probed on a child
process holding a known tensor."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

CHILD = "import torch, sys, time\nkept = torch.ones(1_000_000)\nprint('ready', flush=True)\ntime.sleep(120)\n"


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed")
def test_the_probe_counts_a_live_processs_tensors_and_objects():
    import scheduler_heap

    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # in its sleep, the GIL free
        r = scheduler_heap.probe(child.pid, trim=True)
    finally:
        child.kill()
    assert r["cpu_tensors"] >= 1 and r["cpu_tensor_storage_bytes"] >= 4_000_000  # the kept tensor's 4 MB
    assert r["objects"] > 1000 and dict(r["top_types"])["function"] > 0
    assert 0 < r["rss_after_malloc_trim_mib"] <= r["rss_mib"] + 1
