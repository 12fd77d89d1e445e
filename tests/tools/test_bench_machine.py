"""The machine record every benchmark JSON carries (bench/commands/machine.py)."""

import json

from bench.commands.machine import describe


def test_describe_names_this_machine_and_its_load(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    m = describe()
    json.dumps(m)  # it goes into the benchmark's JSON as is
    assert m["cpu"] and m["cpus"] >= 1 and m["memory_gib"] > 0
    assert m["omp_num_threads"] == "3"
    assert len(m["load_average_before"]) == 3 and all(x >= 0 for x in m["load_average_before"])
