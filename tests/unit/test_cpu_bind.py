"""The OpenMP thread binding sgl_kvq sets for more than one rank on SGLang's CPU engine (sgl_kvq/cpu_engine.py),
without starting an engine: the split, a user's value winning, bad values refused with the reason, and the launch
helpers (`sgl-kvq serve`, Engine kwargs) applying it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sgl_kvq import cpu_engine
from sgl_kvq.cpu_engine import (AUTO_BIND_ENV, RANKS_PER_NODE_ENV, THREADS_BIND_ENV, ThreadBindError,
                                apply_threads_bind, auto_threads_bind, check_threads_bind, rank_ids)


@pytest.fixture
def clean_env(monkeypatch):
    for var in (THREADS_BIND_ENV, AUTO_BIND_ENV, RANKS_PER_NODE_ENV):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_rank_ids_follow_sglangs_gpu_ids():
    assert rank_ids() == [0]
    assert rank_ids(tp_size=2) == [0, 1]
    assert rank_ids(tp_size=2, dp_size=2) == [0, 1, 2, 3]
    assert rank_ids(tp_size=2, base_gpu_id=2, gpu_id_step=2) == [2, 4]


@pytest.mark.parametrize("ids,nodes,bind", [
    ([0], [[0, 1]], None),                                     # one rank per node: SGLang's own default
    ([0, 1], [[0, 1]], "0|1"),                                 # the 2-core dev machine, tp 2 or dp 2
    ([0, 1, 2], [[0, 1]], "0|1|0"),                            # more ranks than cores: they take turns
    ([0, 1], [list(range(8))], "0,1,2,3|4,5,6,7"),
    ([0, 1, 2, 3], [[0, 1, 2, 3], [4, 5, 6, 7]], "0,1|2,3|4,5|6,7"),  # two ranks on each of two nodes
    ([0, 1], [[0, 1], [2, 3]], None),
    ([2, 3], [[0, 1]], "0|0|0|1"),                             # --base-gpu-id 2: indices 0-1 unused
])
def test_auto_binding_splits_each_nodes_cores(ids, nodes, bind):
    assert auto_threads_bind(ids, nodes) == bind


@pytest.mark.parametrize("value,message", [
    ("0", r"has 1 entries, but 2 rank\(s\) need entries for indices \[0, 1\]"),
    ("0|x", r"entry 1 'x' is not a cpu list"),
    ("0|3-1", r"entry 1 '3-1' is not a cpu list"),
    ("0|7", r"entry 1 names cpus \[7\] this process cannot run on \(allowed: 0-1\)"),
])
def test_bad_bindings_are_refused_with_the_reason(value, message):
    with pytest.raises(ThreadBindError, match=message):
        check_threads_bind(value, [0, 1], allowed={0, 1})
    check_threads_bind("0|1", [0, 1], allowed={0, 1})
    check_threads_bind("0-1|0,1|1", [0, 1], allowed={0, 1})  # more entries than ranks is fine


def test_a_users_binding_wins_and_an_automatic_one_follows_the_rank_count(clean_env, monkeypatch):
    monkeypatch.setattr(cpu_engine.os, "sched_getaffinity", lambda pid: {0, 1})
    nodes = [[0, 1]]
    assert apply_threads_bind([0, 1], nodes) == "0|1"
    assert os.environ[THREADS_BIND_ENV] == "0|1" and os.environ[RANKS_PER_NODE_ENV] == "2"
    assert apply_threads_bind([0, 1, 2, 3], nodes) == "0|1|0|1"  # ours: replaced for another rank count
    assert apply_threads_bind([0], nodes) is None  # ours: removed where SGLang's default serves
    assert THREADS_BIND_ENV not in os.environ and RANKS_PER_NODE_ENV not in os.environ
    monkeypatch.setenv(THREADS_BIND_ENV, "1|0")
    assert apply_threads_bind([0, 1], nodes) == "1|0"  # the user's: kept, no node share for the KV budget
    assert RANKS_PER_NODE_ENV not in os.environ and os.environ[THREADS_BIND_ENV] == "1|0"
    with pytest.raises(ThreadBindError):
        apply_threads_bind([0, 1, 2], nodes)


def test_engine_kwargs_and_server_argv_bind_on_the_cpu_engine(clean_env, monkeypatch):
    from bench import launch

    monkeypatch.setattr(launch, "has_gpu", lambda: False)
    monkeypatch.setattr(cpu_engine, "cpus_by_node", lambda: [[0, 1]])
    monkeypatch.setattr(cpu_engine, "cpu_engine_env", lambda apply=True: {})  # keep this process's environment
    launch.engine_kwargs("/m", "kivi2", tp_size=2)
    assert os.environ[THREADS_BIND_ENV] == "0|1"
    launch.engine_kwargs("/m", "kivi2")
    assert THREADS_BIND_ENV not in os.environ
    launch.server_argv(["--model-path", "/m", "--data-parallel-size=2", "--tp-size", "2"])
    assert os.environ[THREADS_BIND_ENV] == "0|1|0|1"


def test_sgl_kvq_serve_refuses_a_bad_binding_before_launching():
    env = {**os.environ, THREADS_BIND_ENV: "0"}
    env.pop(AUTO_BIND_ENV, None)
    proc = subprocess.run([sys.executable, "-m", "bench.cli", "serve", "--model-path", "/nonexistent",
                           "--tp-size", "2"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2, proc.stderr
    assert f"sgl-kvq serve: {THREADS_BIND_ENV}='0' has 1 entries, but 2 rank(s)" in proc.stderr
