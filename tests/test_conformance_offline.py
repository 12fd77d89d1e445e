"""The conformance harness without a server: the kits' downloads are served from the embedded data, every kit
test is collected, and the bf16-baseline rule flags exactly the tests bf16 passes and a dtype does not."""

from __future__ import annotations

import json

from sgl_kvq.commands import bench_conformance as bc


def test_kl_kit_reads_the_essay_prompts_offline(tmp_path, monkeypatch):
    from sglang.test import kl_test_utils

    from sgl_kvq.models import smollm2

    model = smollm2()
    files = bc.prepare_offline_data(model, tmp_path)
    monkeypatch.setattr("datasets.load_dataset", lambda *a, **k: (_ for _ in ()).throw(AssertionError("download")))
    with bc.offline_kits(files):
        ids = kl_test_utils.get_input_ids(tokenizer_path=str(model), num_samples=kl_test_utils.DEFAULT_NUM_SAMPLES)
    assert kl_test_utils.CACHE_DIR != files["longbench_dir"]  # restored
    assert len(ids) == kl_test_utils.DEFAULT_NUM_SAMPLES
    assert all(bc.KL_PROMPT_TAIL[0] <= len(x) % 64 <= bc.KL_PROMPT_TAIL[1] for x in ids)
    assert all(len(x) % 64 + bc.KL_NEW_TOKENS - 1 >= 64 for x in ids), "the decode turn completes no page"
    assert len({tuple(x[:64]) for x in ids}) == len(ids), "two KL prompts share their first page"
    convs = json.loads(open(files["sharegpt"]).read())
    assert len(convs) == 500 and all(len(c["conversations"]) >= 2 for c in convs)


def test_every_listed_kit_is_collected():
    names = bc.kit_test_names()
    kits = {n.split(".")[0] for n in names}
    assert kits == {"api_contract", "decode_correctness", "matched_stop", "abort_all", "scheduler_stress",
                    "kl_divergence", "radix_cache_server", "cache_hit"}
    assert {"kl_divergence.test_input_output_logprobs_match_prefill_cache_hit",
            "kl_divergence.test_input_output_logprobs_match_decode_cache_hit"} <= set(names)


def test_regressions_are_the_tests_bf16_passes_and_the_dtype_does_not():
    base = {"a": {"outcome": "pass"}, "b": {"outcome": "fail"}, "kl": {"outcome": "pass", "kl": 0.0005}}
    rows = {"a": {"outcome": "pass"}, "b": {"outcome": "fail"},
            "kl": {"outcome": "fail", "kl": 0.0031, "message": "AssertionError: avg_kl_div=0.0031 > threshold"}}
    assert list(bc.regressions(base, rows)) == ["kl"]
    assert "0.00310" in bc.regressions(base, rows)["kl"]
    assert bc.regressions(base, {"a": {"outcome": "pass"}}) == {}  # not run is not a regression: listed apart
    report = bc.report_from_tests({"kits": {"bf16": base, "kivi2": rows, "kivi4": {"a": {"outcome": "error"}}}},
                                  "cmd")
    assert report["groups"]["kits"]["kivi2"]["regressions"].keys() == {"kl"}
    assert report["groups"]["kits"]["kivi4"]["not_run"] == ["b", "kl"]
    assert report["groups"]["kits"]["kivi4"]["regressions"].keys() == {"a"}
    assert report["groups"]["kits"]["bf16"]["passed"] == 2


def test_the_baseline_rule_fails_a_regression_and_reports_a_documented_kl_excess(monkeypatch):
    import pytest

    from conformance import against_baseline

    monkeypatch.setattr(bc, "KL_OVER_KIT_THRESHOLD", {"kivi2": {"t_kl": {"measured": 0.15, "bound": 0.25}}})
    base: dict = {}
    against_baseline(base, "bf16", "k.t", {"outcome": "pass"})
    with pytest.raises(pytest.xfail.Exception):  # bf16 itself fails: expected failure for every dtype
        against_baseline(base, "bf16", "k.hard", {"outcome": "fail", "message": "no 391"})
    against_baseline(base, "bf16", "k.t_kl", {"outcome": "pass", "kl": 0.0009})
    against_baseline(base, "kivi2", "k.t", {"outcome": "pass"})
    with pytest.raises(pytest.fail.Exception, match="which bf16 passes"):
        against_baseline(base, "kivi4", "k.t", {"outcome": "error", "message": "500"})
    with pytest.raises(pytest.xfail.Exception):
        against_baseline(base, "kivi2", "k.hard", {"outcome": "fail"})
    with pytest.raises(pytest.xfail.Exception, match="documented"):
        against_baseline(base, "kivi2", "k.t_kl", {"outcome": "fail", "kl": 0.16})
    with pytest.raises(AssertionError, match="over its documented bound"):
        against_baseline(base, "kivi2", "k.t_kl", {"outcome": "fail", "kl": 0.3})
    with pytest.raises(pytest.fail.Exception, match="KL 0.16000"):  # undocumented dtype: a plain failure
        against_baseline(base, "kivi1", "k.t_kl", {"outcome": "fail", "kl": 0.16})
