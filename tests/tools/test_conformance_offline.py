"""The conformance harness without a server: the kits' downloads are served from the embedded data, every kit
test is collected, and the bf16-baseline rule flags exactly the tests bf16 passes and a dtype does not."""

from __future__ import annotations

import json
import os
from pathlib import Path

import conformance
import pytest
from bench.commands import bench_conformance as bc
from bench.commands import conformance_clients as cc
from bench.commands import conformance_table


def test_kl_kit_reads_the_essay_prompts_offline(tmp_path, monkeypatch):
    from sglang.test import kl_test_utils

    from bench.models import smollm2

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

    monkeypatch.setattr(conformance, "KL_OVER_KIT_THRESHOLD", {"kivi2": {"t_kl": {"measured": 0.15, "bound": 0.25}}})
    bf16 = {"k.t": {"outcome": "pass"}, "k.hard": {"outcome": "fail", "message": "no 391"},
            "k.t_kl": {"outcome": "pass", "kl": 0.0009}}
    asked: list[str] = []

    def base(key):
        asked.append(key)
        return bf16[key]

    against_baseline(base, "kivi2", "k.t", {"outcome": "pass"})
    assert asked == []  # a pass needs no baseline: bf16's server never starts for it
    with pytest.raises(pytest.fail.Exception, match="which bf16 passes"):
        against_baseline(base, "kivi4", "k.t", {"outcome": "error", "message": "500"})
    with pytest.raises(pytest.xfail.Exception):
        against_baseline(base, "kivi2", "k.hard", {"outcome": "fail"})
    asked.clear()
    with pytest.raises(conformance.DocumentedFailure, match="documented"):
        against_baseline(base, "kivi2", "k.t_kl", {"outcome": "fail", "kl": 0.16})
    with pytest.raises(AssertionError, match="over its documented bound"):
        against_baseline(base, "kivi2", "k.t_kl", {"outcome": "fail", "kl": 0.3})
    assert asked == []  # documented rows were measured where bf16 passes: no baseline run
    with pytest.raises(pytest.fail.Exception, match="KL 0.16000"):  # undocumented dtype: a plain failure
        against_baseline(base, "kivi1", "k.t_kl", {"outcome": "fail", "kl": 0.16})
    monkeypatch.setattr(conformance, "GREEDY_TEXT_FAILURES", {"kivi1": {"k.t": "no stop in its text"}})
    with pytest.raises(conformance.DocumentedFailure, match="no stop in its text"):
        against_baseline(base, "kivi1", "k.t", {"outcome": "fail"})
    with pytest.raises(pytest.fail.Exception, match="which bf16 passes"):  # documented for kivi1 only
        against_baseline(base, "kivi4", "k.t", {"outcome": "fail"})
    monkeypatch.setattr(conformance, "BF16_NEAR_TIES", {"k.t": "a near-tie"})
    with pytest.raises(pytest.xfail.Exception, match="a near-tie"):  # any dtype: the rounding, not the cache
        against_baseline(base, "kivi4", "k.t", {"outcome": "fail"})


def test_every_documented_failure_is_a_strict_xfail_from_collection():
    """The collection hook marks exactly the (dtype, kit test or program) pairs the expectations file names."""
    from types import SimpleNamespace

    def item(**params):
        marks: list = []
        return SimpleNamespace(callspec=SimpleNamespace(params=params), add_marker=marks.append, marks=marks)

    documented = [item(conformance_server=dtype, kit_test="kl_divergence." + test)
                  for dtype, tests in conformance.KL_OVER_KIT_THRESHOLD.items() for test in tests]
    documented += [item(conformance_server=dtype, **{"kit_test" if "." in key else "program": key})
                   for dtype, keys in conformance.GREEDY_TEXT_FAILURES.items() for key in keys]
    plain = [item(conformance_server="kivi2", kit_test="abort_all.test_abort_all"),
             item(conformance_server="bf16", kit_test=documented[0].callspec.params["kit_test"]),
             item(conformance_server="kivi4", program="test_decode_json_regex"),
             item(conformance_server="kivi1", check="openai_chat_streaming_and_not")]
    conformance.mark_documented_failures([*documented, *plain, SimpleNamespace()])
    assert len(documented) >= 20
    for it in documented:
        (mark,) = it.marks
        assert mark.name == "xfail" and mark.kwargs["strict"] is True, it.callspec.params
        assert mark.kwargs["raises"] is conformance.DocumentedFailure
    assert [it.marks for it in plain] == [[]] * len(plain)


STRICT_XFAILS = """
import pytest

from conformance import KL_OVER_KIT_THRESHOLD, against_baseline, documented_xfail

KL = "kl_divergence.test_input_output_logprobs_match_prefill_cache_hit"
BOUND = KL_OVER_KIT_THRESHOLD["kivi2"][KL.split(".")[1]]["bound"]


@pytest.mark.parametrize("kl", [pytest.param(0.001, id="fixed"), pytest.param(BOUND / 2, id="documented"),
                                pytest.param(BOUND * 2, id="over-its-bound")])
@documented_xfail("kivi2", KL)
def test_kl(kl):
    against_baseline(lambda key: {"outcome": "pass", "kl": 0.0009}, "kivi2", KL,
                     {"outcome": "pass" if kl < 0.002 else "fail", "kl": kl})


@documented_xfail("kivi1", "test_decode_json_regex")
def test_text():
    against_baseline(lambda key: {"outcome": "pass"}, "kivi1", "test_decode_json_regex", {"outcome": "fail"})
"""


def test_a_documented_failure_that_passes_or_fails_otherwise_fails_the_run(tmp_path):
    """Through pytest itself: a documented row that passes is XPASS(strict), one over its bound fails, one that
    fails as documented is an expected failure."""
    import os
    import subprocess
    import sys

    (tmp_path / "test_strict.py").write_text(STRICT_XFAILS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(conformance.__file__).parent), str(ROOT)])}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfx", "-p", "no:cacheprovider", "test_strict.py"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "2 failed, 2 xfailed" in out, out
    assert "FAILED test_strict.py::test_kl[fixed]" in out and "XPASS(strict)" in out, out
    assert "FAILED test_strict.py::test_kl[over-its-bound]" in out and "over its documented bound" in out, out


def test_the_lazy_baseline_starts_bf16_once_at_the_first_miss_and_stops_it(tmp_path, monkeypatch):
    import contextlib

    from conformance import LazyBaseline

    monkeypatch.setenv("KVQ_CONFORMANCE_JSON", str(tmp_path / "rows.json"))
    events: list[str] = []

    @contextlib.contextmanager
    def start():
        events.append("start")
        yield "server"
        events.append("stop")

    baseline = LazyBaseline("kits", start, lambda server, key: {"outcome": "pass", "on": server, "key": key})
    assert events == []  # nothing asked: no server
    assert baseline.row("k.a")["key"] == "k.a" and baseline.row("k.b")["on"] == "server"
    assert baseline.row("k.a")["key"] == "k.a" and events == ["start"]  # one server, each row measured once
    baseline.close()
    assert events == ["start", "stop"]
    assert json.loads((tmp_path / "rows.json").read_text())["kits"]["bf16"].keys() == {"k.a", "k.b"}


ROOT = Path(__file__).resolve().parents[2]
MATRIX = ROOT / "bench/results/conformance-full-smollm2.json"
TABLE_COMMAND = "sgl-kvq bench conformance --table --json bench/results/conformance-full-smollm2.json " \
                "--expected tests/data/expected_failures.json"
TABLES_START = f"<!-- conformance tables: {TABLE_COMMAND} -->"
TABLES_END = "<!-- end of conformance tables -->"


def test_documented_kl_bounds_are_the_committed_matrix():
    """The documented KL bounds (tests/data/expected_failures.json) are what the committed matrix measured (1.6x
    bounds): `--table` prints the entries."""
    expected = conformance_table.kl_entries(json.loads(MATRIX.read_text()))
    assert conformance.KL_OVER_KIT_THRESHOLD == expected, \
        f"copy the entries `{TABLE_COMMAND}` prints into {conformance.EXPECTED_FAILURES}"


def test_the_table_command_compares_a_report_with_the_expectations_file(tmp_path, capsys):
    """`--table --expected PATH` prints the tables and the report's KL entries and exits 1 when PATH's differ."""
    import argparse

    def table(expected: Path) -> int:
        p = argparse.ArgumentParser()
        bc.add_arguments(p)
        return bc.run(p.parse_args(["--table", "--json", str(MATRIX), "--expected", str(expected)]))

    assert table(conformance.EXPECTED_FAILURES) == 0
    out, err = capsys.readouterr()
    assert "| kivi2 |" in out and "differs" not in err
    assert json.loads(err.split(":\n", 1)[1]) == conformance.KL_OVER_KIT_THRESHOLD
    doc = json.loads(conformance.EXPECTED_FAILURES.read_text())
    doc["kl_over_kit_threshold"]["kivi2"]["test_input_output_logprobs_match_prefill_cache_hit"]["bound"] = 0.5
    (tmp_path / "expected.json").write_text(json.dumps(doc))
    assert table(tmp_path / "expected.json") == 1
    assert "differs from" in capsys.readouterr().err


def test_documented_text_failures_are_the_committed_matrix():
    """GREEDY_TEXT_FAILURES names exactly the tests and programs a kvq dtype fails where bf16 passes in the committed
    matrix, KL tests and the programs BF16_NEAR_TIES names aside (rows run where the machine broke the tie the
    other way from bf16's row)."""
    doc = json.loads(MATRIX.read_text())
    failing: dict[str, set] = {}
    for group in ("kits", "programs"):
        base = doc["groups"][group]["bf16"]["tests"]
        for dtype, entry in doc["groups"][group].items():
            for test, row in entry["tests"].items():
                if dtype != "bf16" and test not in conformance_table.KL_TESTS and row["outcome"] != "pass" \
                        and base.get(test, {}).get("outcome") == "pass" \
                        and test.split(".")[-1] not in conformance.BF16_NEAR_TIES:
                    failing.setdefault(dtype, set()).add(test)
    assert failing == {d: set(t) for d, t in conformance.GREEDY_TEXT_FAILURES.items()}


def test_conformance_doc_tables_are_the_committed_matrix():
    doc = (ROOT / "docs" / "conformance.md").read_text()
    assert TABLES_START in doc and TABLES_END in doc
    block = doc.split(TABLES_START)[1].split(TABLES_END)[0].strip()
    tables = conformance_table.readme_tables(json.loads(MATRIX.read_text()), conformance.KL_OVER_KIT_THRESHOLD)
    assert block == tables, \
        f"paste into docs/conformance.md the tables `{TABLE_COMMAND}` prints"


def _kl(kl: float) -> dict:
    return {"outcome": "pass" if kl < bc.KIT_KL_THRESHOLD else "fail", "kl": kl}


def test_the_table_names_each_failure_by_its_kind():
    prefix, decode = conformance_table.KL_TESTS
    bounds = {"measured": 0.1, "bound": 0.16}
    documented = {"kivi2": {prefix.split(".")[1]: bounds, decode.split(".")[1]: bounds}}
    base = {"k.a": {"outcome": "pass"}, "k.model": {"outcome": "fail"}, prefix: _kl(0.0009), decode: _kl(0.0009)}
    doc = {"kits": {"bf16": base,
                    "kivi2": {"k.a": {"outcome": "pass"}, "k.model": {"outcome": "pass"}, prefix: _kl(0.1),
                              decode: _kl(0.2)},
                    "kivi1": {"k.a": {"outcome": "error"}, "k.model": {"outcome": "fail"}, prefix: _kl(0.003)}},
           "programs": {"bf16": {"p": {"outcome": "pass"}}, "kivi1": {"p": {"outcome": "fail"}}}}
    report = bc.report_from_tests(doc, "cmd")
    table = conformance_table.kits_table(report, documented)
    rows = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()}
    assert "`model`" in rows["bf16"] and "0.0009" in rows["bf16"]
    # kivi2: the prefix KL is under its documented bound, the decode KL over it (a regression); it passes `model`
    assert "passes `model`" in rows["kivi2"] and "| `KL prefix hit` |" in rows["kivi2"]
    assert "**1: `KL decode hit`**" in rows["kivi2"] and "0.16 / 0.16" in rows["kivi2"]
    # kivi1: undocumented KL and an error where bf16 passes; the decode KL test was not run
    assert "**2: `a`, `KL prefix hit`**" in rows["kivi1"] and "| `KL decode hit` |" in rows["kivi1"]
    programs = conformance_table.clients_table(report).splitlines()
    assert "**1: `p`**" in programs[-1] and programs[-1].startswith("| kivi1 |")
    assert conformance_table.kl_entries(report) == {
        "kivi2": {prefix.split(".")[1]: {"measured": 0.1, "bound": 0.16},
                  decode.split(".")[1]: {"measured": 0.2, "bound": 0.32}},
        "kivi1": {prefix.split(".")[1]: {"measured": 0.003, "bound": 0.0048}}}


def test_a_kvq_dtype_skips_what_bf16_fails_and_the_table_counts_it():
    by_dtype = {"bf16": {"k.a": {"outcome": "pass"}, "k.model": {"outcome": "fail"}, "k.cpu": {"outcome": "error"},
                         "server": {"outcome": "error"}}, "kivi1": {"k.b": {"outcome": "pass"}}}
    assert bc.baseline_failures(by_dtype) == {"k.model", "k.cpu"}
    del by_dtype["bf16"]["server"]
    report = bc.report_from_tests({"kits": by_dtype}, "cmd")
    kivi1 = conformance_table.kits_table(report, {}).splitlines()[-1]
    assert "| `a`, 2 bf16 fails |" in kivi1


def test_a_resumed_dtype_owes_only_what_it_has_no_rows_for():
    every = set(bc.kit_test_names())
    assert bc.missing("kits", every) == []
    assert bc.missing("kits", every - {"matched_stop.test_finish_stop_eos"}) == ["matched_stop"]
    assert bc.missing("kits", {"abort_all.*"}) == [k for k in bc.missing("kits", set()) if k != "abort_all"]
    assert bc.missing("clients", {"openai_chat_streaming_and_not"}) == ["openai_completions_streaming_and_not"]
    assert bc.missing("programs", set(cc.PROGRAMS) - {"test_regex"}) == ["test_regex"]


def test_a_client_row_is_a_pass_a_failure_an_error_or_a_timeout():
    import time

    def fail():
        raise AssertionError("streamed 'a' vs not 'b'")

    assert cc.timed_row(lambda: None)["outcome"] == "pass"
    row = cc.timed_row(fail)
    assert row.pop("seconds") < 1  # rounded to 0.1 s: 0.0 on a quiet machine, 0.1 on a loaded one
    assert row == {"outcome": "fail", "message": "streamed 'a' vs not 'b'"}
    assert cc.timed_row(lambda: {}["x"])["message"] == "KeyError: 'x'"

    def bare():  # test_programs.py's bare asserts carry no message (pytest's rewriting would add one here)
        raise AssertionError

    assert cc.timed_row(bare)["message"] == "bare: raise AssertionError"
    row = cc.timed_row(lambda: time.sleep(5), timeout_s=0.2)
    assert row["outcome"] == "error" and "no answer within 0.2 s" in row["message"] and row["seconds"] < 2


def _fake_program(monkeypatch, outcomes):
    """test_programs.test_decode_json replaced by one that fails or passes in the order given; calls counted."""
    from sglang.test import test_programs

    calls = []

    def program():
        calls.append(1)
        assert outcomes[len(calls) - 1], "a bad draw"

    monkeypatch.setattr(test_programs, "test_decode_json", program)
    monkeypatch.setattr(test_programs, "test_regex", program)
    monkeypatch.setattr(cc, "_endpoint", lambda base_url: None)  # a RuntimeEndpoint would ask a server
    monkeypatch.setattr("sglang.set_default_backend", lambda backend: None)
    return calls


def test_a_sampling_program_passes_on_its_first_passing_draw(monkeypatch):
    calls = _fake_program(monkeypatch, [False, True, False])
    row = cc.run_program("http://127.0.0.1:1", "test_decode_json")
    assert row["outcome"] == "pass" and row["draws"] == 2 and len(calls) == 2


def test_a_sampling_program_fails_when_every_draw_fails(monkeypatch):
    calls = _fake_program(monkeypatch, [False] * cc.SAMPLED_DRAWS)
    row = cc.run_program("http://127.0.0.1:1", "test_decode_json")
    assert row["outcome"] == "fail" and row["draws"] == cc.SAMPLED_DRAWS == len(calls) > 1


def test_a_greedy_program_runs_once(monkeypatch):
    calls = _fake_program(monkeypatch, [False, True])
    row = cc.run_program("http://127.0.0.1:1", "test_regex")
    assert row["outcome"] == "fail" and "draws" not in row and len(calls) == 1


def test_every_sampling_program_is_a_program():
    assert cc.SAMPLED_PROGRAMS <= set(cc.PROGRAMS) and "test_regex" not in cc.SAMPLED_PROGRAMS


def test_a_dtype_entry_carries_its_knobs_and_an_unknown_one_is_refused():
    """`kivimix:KVQ_RECIPE=NAME` starts a kivimix server with that recipe (not bf16 under the entry's name); an entry
    that is no dtype stops the run before any server starts."""
    knobs = bc.dtype_knobs(["bf16", "kivimix:KVQ_RECIPE=smollm2-2.5"])
    assert knobs["kivimix:KVQ_RECIPE=smollm2-2.5"] == ("kivimix", {"KVQ_RECIPE": "smollm2-2.5"})
    assert bc.server_args("M", knobs["kivimix:KVQ_RECIPE=smollm2-2.5"][0])[-2:] == ["--kv-cache-dtype", "kivimix"]
    with pytest.raises(SystemExit, match="kivi9"):
        bc.dtype_knobs(["bf16", "kivi9"])


def test_a_run_records_the_knobs_every_server_inherited_not_an_entrys_own(tmp_path, monkeypatch):
    """An entry's knobs (kivimix:KVQ_RECIPE=NAME) are its server's alone: the report's kvq_env, which the decision
    table reads as knobs the whole run changed, is the environment before them."""
    import argparse
    import contextlib

    import bench.launch

    seen = []

    @contextlib.contextmanager
    def server(args, log_path, env=None):
        seen.append({**os.environ, **(env or {})}.get("KVQ_RECIPE"))  # what the server process would see
        yield "server"

    def groups(server, model, files, todo, skip, keep):
        keep("kits", {"kl_divergence.t": {"outcome": "pass"}})

    monkeypatch.delenv("KVQ_RECIPE", raising=False)
    monkeypatch.setattr(bench.launch, "ServerProcess", server)
    monkeypatch.setattr(bc, "prepare_offline_data", lambda model, workdir: {})
    monkeypatch.setattr(bc, "run_groups", groups)
    out = tmp_path / "kl.json"
    args = argparse.Namespace(table=False, from_tests=None, model=str(tmp_path), dtypes="kivimix:KVQ_RECIPE=r1",
                              groups="kits", kits="", logs=str(tmp_path / "logs"), kv_cache_gb=1.0, resume=False,
                              json=str(out), all_tests=False)
    bc.run(args)
    assert seen == [None, "r1"]  # bf16, then the entry's server with its recipe
    report = json.loads(out.read_text())
    assert "KVQ_RECIPE" not in report["kvq_env"] and report["kvq_env"]["KVQ_KV_CACHE_GB"] == "1.0"
    assert set(report["groups"]["kits"]) == {"bf16", "kivimix:KVQ_RECIPE=r1"}
