"""What a benchmark ran on, recorded in its JSON: run-to-run comparisons of wall time hold only on the same machine
(this project's 2-core machines have differed by 1.5x in bf16's decode step, 43 vs 65 ms at B=1 and 1k tokens), and
only when nothing else loaded it (docs/results.md, "Where a decode step's time goes")."""

from __future__ import annotations

import os
import platform


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def describe() -> dict:
    """The CPU model, its logical CPUs, the memory, OMP_NUM_THREADS and the load averages (1, 5, 15 minutes) now:
    call it before the first server starts, so the load is the machine's, not the benchmark's."""
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"cpu": _cpu_model(), "cpus": os.cpu_count(), "memory_gib": _memory_gib(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"), "load_average_before": load}
