"""The contended-vs-uncontended run shared by the e2e modules: 8 requests x 160 tokens of the tiny bf16 Llama,
uncontended (a pool that holds them all) and contended (a pool that holds a few, with SGLang's retraction test mode
on). bf16's pair of runs is every dtype's baseline and is identical in every module, so it runs once per test
session, shared by the xdist workers through a file. bf16: 4,096 and 1,024 tokens (16 pages). A kvq pool's running
requests also take their fp16 frames from it (8 pages of 64 tokens each at 2 bit for this model's 16 channels, 1,024
tokens a request): 16,384 and 4,096 tokens (about 3 requests' frames at once)."""

from __future__ import annotations

import fcntl
import json
import os
import random
import re
import tempfile
from pathlib import Path

from bench.models import tiny_llama
from engine_runs import GREEDY, agreement, run_engine

# Every token's KV a function of the tokens alone: the mode in which a contended run must agree with its
# uncontended run at least as well as bf16's does.
DETERMINISTIC = {"KVQ_PREFILL": "paged", "KVQ_RESIDUAL": "0"}

_BF16: dict[str, tuple[list[list[int]], float]] = {}


def contended_prompts(n: int = 8, words: int = 120) -> list[str]:
    rng = random.Random(0)
    vocab = "def class return import from self lambda yield while for if else try except with as print".split()
    return [" ".join(rng.choice(vocab) for _ in range(words)) for _ in range(n)]


def _bf16_once(compute) -> tuple[list[list[int]], float]:
    """bf16's pair, computed by the first worker that asks and read back by the others (one test run's workers
    share PYTEST_XDIST_TESTRUNUID): it is the same deterministic pair of runs in each (a minute of a CI worker)."""
    if "auto" not in _BF16:
        run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
        if run is None:
            _BF16["auto"] = compute()
        else:
            path = Path(tempfile.gettempdir()) / f"sgl_kvq-contended-bf16-{run}.json"
            with open(path.with_suffix(".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker waits for the pair rather than repeat it
                if not path.exists():
                    path.write_text(json.dumps(compute()))
                free, agree = json.loads(path.read_text())
            _BF16["auto"] = (free, agree)
    return _BF16["auto"]


def uncontended_and_contended(dtype: str, env: dict, capfd) -> tuple[list[list[int]], float]:
    """-> (the uncontended run's tokens, the contended run's agreement with it). Every contended request must
    complete and the contended run must have retracted a request (read from the engine's log)."""
    if dtype == "auto" and not env:
        return _bf16_once(lambda: _runs(dtype, env, capfd))
    return _runs(dtype, env, capfd)


def _runs(dtype: str, env: dict, capfd) -> tuple[list[list[int]], float]:
    model = tiny_llama(dtype="bfloat16")
    prompts = contended_prompts()
    roomy, tight_cap = (4096, 1024) if dtype == "auto" else (16384, 4096)
    free, _ = run_engine(model, dtype, prompts, max_total_tokens=roomy, dtype="bfloat16", env=env)
    capfd.readouterr()
    tight, stats = run_engine(model, dtype, prompts, max_total_tokens=tight_cap, dtype="bfloat16",
                              env={**env, "SGLANG_TEST_RETRACT": "1"})
    assert tight_cap - 8 * 64 < stats["capacity_tokens"] <= tight_cap  # kvq: rounded down to whole frames
    assert all(len(o) == GREEDY["max_new_tokens"] for o in tight), f"{dtype}: a request did not complete"
    assert re.search(r"#retracted_reqs: [1-9]", capfd.readouterr().err), f"{dtype}: no request was retracted"
    return free, agreement(free, tight)


def contended_agreement_in_the_deterministic_mode(dtype: str, capfd) -> dict[str, float]:
    """{"auto": bf16's, dtype: dtype's (in the deterministic mode)} agreement of the contended run with the
    uncontended one."""
    return {"auto": uncontended_and_contended("auto", {}, capfd)[1],
            dtype: uncontended_and_contended(dtype, DETERMINISTIC, capfd)[1]}
