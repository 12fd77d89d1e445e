"""`sgl-kvq eval niah | ppl | agree` through the real engine on the tiny random Llama (float32), plus their pure parts.

The engine tests run the CLI in a subprocess (SGLang spawns its scheduler processes) and read its --json output."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from collections import Counter

import pytest

from bench.commands import eval_agree, eval_niah
from bench.eval import engine_eval as ee
from bench.eval import needles
from slices import matrix_only

TINY = ["--model", "tiny", "--max-total-tokens", "4096", "--max-running-requests", "4"]


def _eval(tmp_path, what: str, *args) -> tuple[dict, subprocess.CompletedProcess]:
    out = tmp_path / f"{what}.json"
    proc = subprocess.run([sys.executable, "-m", "bench.cli", "eval", what, *TINY, *args, "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert out.exists(), f"sgl-kvq eval {what} wrote no JSON (rc {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(out.read_text()), proc


def _by_dtype(result: dict) -> dict:
    return {r["kv_cache_dtype"]: r for r in result["results"]}


def _check_pool(rows: dict) -> None:
    for dt, r in rows.items():
        p = r["kv_pool"]
        # a pooled kvq pool is rounded to whole frames (the fp32 tiny Llama's kivi2: 4,032 of 4,096, a frame being at
        # most 16 of its 64-token pages)
        assert 4096 - 16 * 64 < p["capacity_tokens"] <= 4096, (dt, p)
        assert p["kv_bytes"] > 0 and p["kv_bytes_per_token"] > 0, dt
        assert r["wall_s"] > 0 and r["startup_s"] > 0
    auto, kivi2 = rows["auto"]["kv_pool"], rows["kivi2"]["kv_pool"]
    assert "base_bytes_per_token" not in auto
    # fp32 tiny model: 2 layers x (K, V) x 2 KV heads x 16 dims x 4 B = 512 B/token; kivi2 stores 2-bit codes
    assert kivi2["base_bytes_per_token"] < kivi2["kv_bytes_per_token"] < auto["kv_bytes_per_token"]


def test_dtype_list_parsing():
    p = argparse.ArgumentParser()
    ee.add_common_arguments(p)
    assert ee.dtypes(p.parse_args([])) == ["auto", "kivi4", "kivi2", "kivi1"]
    assert ee.dtypes(p.parse_args(["--kv-cache-dtype", "kivi2,auto", "--kv-cache-dtype", "kivi1"])) == \
        ["kivi2", "auto", "kivi1"]
    with pytest.raises(SystemExit):
        ee.dtypes(p.parse_args(["--kv-cache-dtype", "kivi5"]))


def test_a_dtype_entry_carries_knobs_for_its_engine_only(monkeypatch):
    import os

    p = argparse.ArgumentParser()
    ee.add_common_arguments(p)
    entries = ee.dtypes(p.parse_args(["--kv-cache-dtype", "kivi2,kivi2:KVQ_ROTATE=hadamard:KVQ_PREFILL=paged"]))
    assert entries == ["kivi2", "kivi2:KVQ_ROTATE=hadamard:KVQ_PREFILL=paged"]
    assert ee.split_knobs(entries[1]) == ("kivi2", {"KVQ_ROTATE": "hadamard", "KVQ_PREFILL": "paged"})
    for bad in ("kivi5:KVQ_ROTATE=hadamard", "kivi2:ROTATE=hadamard", "kivi2:KVQ_ROTATE"):
        with pytest.raises(SystemExit):
            ee.dtypes(p.parse_args(["--kv-cache-dtype", bad]))
    monkeypatch.setenv("KVQ_PREFILL", "full")
    monkeypatch.delenv("KVQ_ROTATE", raising=False)
    with ee.knob_env({"KVQ_ROTATE": "hadamard", "KVQ_PREFILL": "paged"}):
        assert (os.environ["KVQ_ROTATE"], os.environ["KVQ_PREFILL"]) == ("hadamard", "paged")
    assert "KVQ_ROTATE" not in os.environ and os.environ["KVQ_PREFILL"] == "full"


def test_first_divergence_reports_the_reference_margin():
    assert eval_agree.first_divergence([1, 2, 3], [1, 2, 3], [0.5, 0.1, 2.0]) is None
    assert eval_agree.first_divergence([1, 2, 3], [1, 5, 3], [0.5, 0.1, 2.0]) == {"pos": 1, "ref_margin": 0.1}


def test_agreement_metrics():
    assert eval_agree.agreement([1, 2, 3, 4], [1, 2, 3, 4]) == {"match": 1.0, "prefix": 1.0, "identical": True}
    assert eval_agree.agreement([1, 2, 3, 4], [1, 9, 3, 4]) == {"match": 0.75, "prefix": 0.25, "identical": False}
    s = eval_agree.summarize([eval_agree.agreement([1, 2], [1, 2]), eval_agree.agreement([1, 2], [5, 2])])
    assert s == {"match_frac": 0.75, "common_prefix_frac": 0.5, "identical_share": 0.5}


def test_flush_tail_covers_the_overlay_ring():
    tail = ee.FlushTail(1000, True, seed=1)
    a, b = tail(), tail()
    assert len(a) == 2 * 64 + 1 and a != b and all(250 <= x < 999 for x in a)
    assert ee.FlushTail(1000, False)() == []


def _tiny_niah_prompts(length: int):
    from bench import models

    tok = ee.tokenizer(models.tiny_llama())
    return tok, eval_niah.Prompts(tok, length)


@pytest.mark.parametrize("needle", [needles.NEEDLES[0], needles.NEEDLES[4], needles.NEEDLES[8]])
def test_niah_haystack_is_a_prefix_with_the_needle_near_depth(needle):
    tok, prompts = _tiny_niah_prompts(512)
    tail, sentence = prompts.tail(needle), prompts.needle(needle)
    for depth in (0.0, 0.5, 1.0):
        hay, at = prompts.haystack(512, depth, needle)
        assert len(hay) + len(tail) == 512
        assert hay[at:at + len(sentence)] == sentence
        body = 512 - len(prompts.head) - len(tail) - len(sentence)
        assert int(depth * body) - 200 <= at - len(prompts.head) <= int(depth * body)
    assert needle.answer in tok.decode(sentence)
    assert tok.decode(tail).rstrip().endswith(needle.answer_prefix)


def test_needle_halves_split_every_kind_and_depth_evenly():
    """Defaults are chosen on one half and reported on the other: the halves share no needle, each has two of every
    kind, and each covers every depth over the default lengths."""
    choose, report = needles.HALVES["choose"], needles.HALVES["report"]
    assert not set(choose) & set(report) and set(choose) | set(report) == set(needles.NEEDLES)
    for half in (choose, report):
        assert Counter(n.kind for n in half) == {"digits": 2, "name": 2, "phrase": 2}
        trials = needles.schedule(half, [1024, 2048, 4096])
        assert len(trials) == 18 and {d for _, _, d in trials} == set(needles.DEPTHS)
    for n in needles.NEEDLES:  # the answer is in the sentence, after the prefix the assistant turn starts with
        assert n.sentence.startswith(n.answer_prefix) and n.answer in n.sentence[len(n.answer_prefix):]


def test_niah_plan_single_runs_the_given_needle_at_every_depth():
    p = argparse.ArgumentParser()
    eval_niah.add_arguments(p)
    args = p.parse_args(["--needle-set", "single", "--lengths", "320,640", "--depths", "0.2,0.8", "--needle",
                         "The cat is called Tibbles.", "--answer", "Tibbles", "--answer-prefix", "The cat is called"])
    trials = eval_niah.plan(args)
    assert [(length, depth) for _, length, depth in trials] == [(320, 0.2), (320, 0.8), (640, 0.2), (640, 0.8)]
    assert {n.sentence for n, _, _ in trials} == {"The cat is called Tibbles."}
    assert len(eval_niah.plan(p.parse_args(["--needle-set", "report"]))) == 18


@pytest.mark.slow
@pytest.mark.engine
@matrix_only("a measurement run (`sgl-kvq eval`, 106 s); its parts are checked offline above")
def test_ppl_turns_read_the_cache(tmp_path):
    res, proc = _eval(tmp_path, "ppl", "--kv-cache-dtype", "auto,kivi2", "--turns", "3", "--turn-tokens", "128")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _by_dtype(res)
    _check_pool(rows)
    for dt, r in rows.items():
        # turn t's prefix (whole earlier turns, 2 pages each) came from the radix cache
        assert r["cached_tokens"] == [0, 128, 256], dt
        assert [t["scored"] for t in r["turns"]] == [128, 128, 128]
        assert math.isfinite(r["ppl_cached_turns"]) and r["ppl_cached_turns"] > 1
        assert r["flush_tail_tokens"] == 129
    # random tiny model: near-uniform over its 1000-token vocabulary, and 2-bit KV must not wreck that
    assert 300 < rows["auto"]["ppl_all"] < 3000
    assert abs(rows["kivi2"]["ppl_cached_turns"] / rows["auto"]["ppl_cached_turns"] - 1) < 0.05
    assert res["tokens"] == 3 * 128 + 1 and "sgl-kvq eval ppl" in res["command"]


@pytest.mark.slow
@pytest.mark.engine
@matrix_only("a measurement run (`sgl-kvq eval`, 64 s); its parts are checked offline above")
def test_niah_question_hits_the_cached_haystack(tmp_path):
    res, proc = _eval(tmp_path, "niah", "--kv-cache-dtype", "kivi2", "--needle-set", "single", "--lengths", "320",
                      "--depths", "0.2,0.8", "--max-new-tokens", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (r,) = res["results"]
    assert r["kv_cache_dtype"] == "kivi2" and r["kv_pool"]["base_bytes_per_token"] > 0
    assert len(r["trials"]) == 2 and 0 <= r["accuracy"] <= 1
    prompts, needle = _tiny_niah_prompts(320)[1], needles.NEEDLES[0]  # the single set's default needle
    for t in r["trials"]:
        assert t["prompt_tokens"] == 320 and t["kind"] == "custom" and t["needle"] == needle.sentence
        # every complete page of request 1's haystack was cached: request 2 re-reads them from the pool
        assert t["cached_tokens"] == (320 - len(prompts.tail(needle))) // 64 * 64 > 0
        assert t["needle_in_cache"] == (t["needle_token"] + len(prompts.needle(needle)) <= t["cached_tokens"])
        assert isinstance(t["hit"], bool) and isinstance(t["answer"], str)


@pytest.mark.slow
@pytest.mark.engine
@matrix_only("a measurement run (`sgl-kvq eval`, 152 s); its parts are checked offline above")
def test_agree_bf16_reproduces_itself_and_kivi2_is_measured(tmp_path):
    res, proc = _eval(tmp_path, "agree", "--kv-cache-dtype", "auto,kivi2", "--prompts", "2", "--prompt-tokens", "192",
                      "--new-tokens", "12")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _by_dtype(res)
    _check_pool(rows)
    # a second, independent bf16 engine must decode exactly the reference's tokens
    assert rows["auto"]["match_frac"] == 1.0 and rows["auto"]["identical_share"] == 1.0
    assert rows["auto"]["output_ids"] == res["reference"]["output_ids"]
    assert rows["auto"]["first_divergence"] == [None, None]
    margins = res["reference"]["top2_margins"]
    assert [len(m) for m in margins] == [12, 12] and all(m >= 0 for ms in margins for m in ms)
    k = rows["kivi2"]
    assert 0 <= k["match_frac"] <= 1 and 0 <= k["common_prefix_frac"] <= k["match_frac"]
    assert [len(x) for x in k["output_ids"]] == [12, 12]
    for i, d in enumerate(k["first_divergence"]):
        assert (d is None) == k["per_prompt"][i]["identical"]
        assert d is None or (d["pos"] == round(k["per_prompt"][i]["prefix"] * 12) and d["ref_margin"] >= 0)
    assert [p["tokens"] for p in res["prompts"]] == [192, 192]
    assert res["prompts"][0]["source"].startswith("essay") and res["prompts"][1]["source"].startswith("sharegpt")
