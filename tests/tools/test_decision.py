"""`sgl-kvq bench decision` without an engine: the collector on small result files shaped like the committed ones
(missing cells, the newest file wins, which files count), the Pareto front on a known set, bytes per token from the
layout, `--run`'s commands, and the committed README block and docs/decision.md against what the committed JSONs
give. The figure's checks are in tests/tools/test_plots.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from bench.commands import bench_decision
from bench.decision import render, sources
from bench.decision.cells import BF16, MISSING, OLD_NEEDLES, OTHER_LAYERS, OVER_KIT, RECIPE_ROW, collect
from bench.decision.front import fronts, pareto_front
from bench.decision.missing import command, missing
from bench.decision.models import GEMMA3, MODELS, SMOLLM2

ROOT = Path(__file__).resolve().parents[2]


def write(folder: Path, name: str, doc: dict, day: int | None = None) -> Path:
    """A result file; `day` sets when it finished (2030-01-<day>: after every dtype's defaults last changed, so a
    test's files are read whatever a dtype's defaults are now), else it has no finished_at."""
    if day is not None:
        doc = {**doc, "finished_at": f"2030-01-{day:02d}T12:00:00+00:00"}
    path = folder / name
    path.write_text(json.dumps(doc))
    return path


def ppl(rows: dict[str, float], command: str = "sgl-kvq eval ppl", turns: int = 24) -> dict:
    return {"eval": "ppl", "model": "/cache/smollm2-135m-instruct", "command": command,
            "settings": {"turns": turns, "turn_tokens": 192, "text": "paul graham essays"},
            "results": [{"kv_cache_dtype": d, "ppl_cached_turns": v} for d, v in rows.items()]}


def niah(trials: dict[str, list[tuple[str | None, bool]]]) -> dict:
    """trials: dtype -> [(half, hit)]; a None half writes a trial from before the split (no "half" key)."""
    return {"eval": "niah", "model": "smollm2", "command": "sgl-kvq eval niah",
            "results": [{"kv_cache_dtype": d, "trials": [{"hit": hit} if half is None else {"half": half, "hit": hit}
                                                         for half, hit in ts]} for d, ts in trials.items()]}


def attention(layers: list[int], errs: dict[str, list[float]]) -> dict:
    """errs: a served dtype (or fp16, the reference) -> its per-layer errors, under the dtype's method name."""
    from bench.eval.attention import DTYPE_METHODS

    return {"methods": {DTYPE_METHODS.get(d, d): {"attn_err": sum(e) / len(e), "per_layer": {"attn_err": e}}
                        for d, e in errs.items()},
            "capture_check": {"max_rel_err": 0.0}, "layers": layers, "model": "smollm2",
            "settings": {"group_size": 64, "value_group": 64, "residual": 64, "window": 10},
            "command": "sgl-kvq eval attention"}


def capacity(rows: list[tuple[str, dict, float]]) -> dict:
    return {"model": "smollm2", "command": "sgl-kvq bench capacity",
            "runs": [{"kv_cache_dtype": d, "budget": b, "x_bf16_per_budget": x} for d, b, x in rows]}


def conformance(kl: dict[str, tuple[float, float]]) -> dict:
    tests = {d: {"tests": {"kl_divergence.test_input_output_logprobs_match_prefill_cache_hit": {"kl": a},
                           "kl_divergence.test_input_output_logprobs_match_decode_cache_hit": {"kl": b}}}
             for d, (a, b) in kl.items()}
    return {"groups": {"kits": tests}, "kit_kl_threshold": 0.002, "command": "sgl-kvq bench conformance"}


def table_of(folder: Path):
    found, skipped = sources.load(sources.discover(folder), folder)
    return collect(found, skipped)


def test_missing_cells_print_a_dash_and_the_command_that_measures_them(tmp_path):
    write(tmp_path, "ppl.json", ppl({"auto": 20.0, "kivi2": 25.0}), day=1)
    table = table_of(tmp_path)
    kivi2, kivi4 = table.row("kivi2"), table.row("kivi4")
    assert kivi2.cell("ppl_delta").text == "+25.0%" and kivi2.cell("ppl_delta").source == "ppl.json"
    assert kivi4.cell("ppl").missing and kivi4.cell("ppl").text == MISSING
    assert kivi4.cell("bytes").text == "6,480"  # the layout's, never missing
    gaps = {(g.kind, g.measurable): g.dtypes for g in missing(table)}
    assert "kivi2" not in gaps[("ppl", True)] and "kivi4" in gaps[("ppl", True)]
    # every served dtype has an attention method (SpeCache's read: tools/eval/specache.py), so a command for each;
    # a recipe's rows (a width per layer) have none offline yet
    assert all(d.startswith(RECIPE_ROW) for d in gaps.get(("attention", False), ()))
    assert {"specache1", "specache2"} <= set(gaps[("attention", True)])
    page = render.docs(table)
    assert "specache1,specache2" in page
    assert "| `kivi4` | 6,480 | — |" in page
    assert "sgl-kvq eval ppl --kv-cache-dtype auto,kivi1,kivi3,kivi4," in page


def test_the_newest_file_wins_each_cell_and_says_which_it_is(tmp_path):
    write(tmp_path, "a-new.json", ppl({"auto": 20.0, "kivi2": 30.0}), day=5)
    write(tmp_path, "z-old.json", ppl({"auto": 20.0, "kivi2": 22.0, "kivi1": 20.2}), day=1)
    table = table_of(tmp_path)
    assert table.row("kivi2").cell("ppl").text == "30.00" and table.row("kivi2").cell("ppl").source == "a-new.json"
    assert table.row("kivi1").cell("ppl").source == "z-old.json"  # only the older file measured it
    page = render.docs(table)
    assert "30.00 [1](../a-new.json)" in page and "1. [a-new.json](../a-new.json)" in page


def test_ppl_and_its_delta_come_from_one_file_that_ran_bf16(tmp_path):
    write(tmp_path, "with-bf16.json", ppl({"auto": 20.0, "gear2": 24.0}), day=1)
    write(tmp_path, "newer-without.json", ppl({"gear2": 26.0}), day=9)
    write(tmp_path, "only.json", ppl({"zipcache2": 21.0}), day=2)
    table = table_of(tmp_path)
    gear2 = table.row("gear2")
    assert (gear2.cell("ppl").text, gear2.cell("ppl_delta").text) == ("24.00", "+20.0%")
    assert {gear2.cell("ppl").source, gear2.cell("ppl_delta").source} == {"with-bf16.json"}
    zipcache2 = table.row("zipcache2")
    assert zipcache2.cell("ppl").text == "21.00" and zipcache2.cell("ppl_delta").missing


def test_file_times_order_files_without_finished_at(tmp_path):
    """Outside git (or changed in it) a file's modification time dates it (zipcache2: its defaults never changed,
    so files of any time are read for it)."""
    old = write(tmp_path, "b.json", ppl({"auto": 20.0, "zipcache2": 40.0}))
    new = write(tmp_path, "a.json", ppl({"auto": 20.0, "zipcache2": 30.0}))
    os.utime(old, (1_000_000, 1_000_000))
    os.utime(new, (2_000_000, 2_000_000))
    assert table_of(tmp_path).row("zipcache2").cell("ppl").source == "a.json"
    os.utime(old, (3_000_000, 3_000_000))
    assert table_of(tmp_path).row("zipcache2").cell("ppl").source == "b.json"


def test_runs_with_a_knob_changed_are_not_read(tmp_path):
    write(tmp_path, "w21.json", ppl({"auto": 20.0, "logquant2": 21.0}, "KVQ_LOGQUANT_WINDOW=21 sgl-kvq eval ppl"), 3)
    write(tmp_path, "topk.json", {**ppl({"auto": 20.0, "specache1": 20.5}), "kvq_env": {"KVQ_TOPK": "256"}}, 4)
    write(tmp_path, "recall.json", {**ppl({"auto": 20.0, "specache2": 20.1}),
                                    "kvq_env": {"KVQ_SPECACHE_RECALL": "1", "KVQ_ATTENTION_THREADS": "1"}}, 5)
    write(tmp_path, "other.json", {**ppl({"auto": 9.0, "kivi2": 9.5}), "model": "/cache/llama-3-8b"}, 6)
    write(tmp_path, "g32.json", {**attention([0], {"fp16": [0.0], "kivi2": [0.3]}),
                                 "settings": {"group_size": 32}}, 7)
    write(tmp_path, "text.json", {**ppl({"auto": 18.0, "gear2": 19.0}),
                                  "settings": {"text": "/tmp/other.txt", "turns": 24, "turn_tokens": 192}}, 8)
    write(tmp_path, "short.json", ppl({"auto": 18.0, "gearl2": 19.0}, turns=8), 9)
    table = table_of(tmp_path)
    assert table.row("gear2").cell("ppl").missing  # another text: its perplexities are not the column's
    assert table.row("gearl2").cell("ppl").missing  # another length of it: neither
    assert table.row("logquant2").cell("ppl").missing and table.row("specache1").cell("ppl").missing
    assert table.row("specache2").cell("ppl").text == "20.10"  # a reported counter and the thread count change nothing
    assert table.row("kivi2").cell("ppl").missing and table.row("kivi2").cell("attn").missing
    why = dict(table.skipped)
    assert "KVQ_LOGQUANT_WINDOW" in why["w21.json"] and "KVQ_TOPK" in why["topk.json"]
    assert "llama-3-8b" in why["other.json"] and "group_size=32" in why["g32.json"]
    assert "text=/tmp/other.txt" in why["text.json"] and "turns=8 x 192" in why["short.json"]


def test_engine_results_from_before_a_dtypes_defaults_changed_are_not_read_for_it(tmp_path, monkeypatch):
    """A dtype whose defaults changed (here kivi4's, on day 29) takes its engine columns from files measured since;
    the layout's capacity and the offline attention error do not depend on them and stay read."""
    from datetime import datetime

    from bench.decision import cells

    changed = datetime.fromisoformat("2030-01-29T00:00:00+00:00").timestamp()
    monkeypatch.setattr(cells, "defaults_changed", lambda dtype: changed if dtype == "kivi4" else None)
    write(tmp_path, "old.json", ppl({"auto": 20.0, "kivi4": 20.1, "kivi2": 24.0}), day=28)
    write(tmp_path, "old-kl.json", conformance({"kivi4": (0.0024, 0.0023)}), day=28)
    write(tmp_path, "old-attn.json", attention([0], {"fp16": [0.0], "kivi4": [0.1]}), day=28)
    write(tmp_path, "old-cap.json", capacity([("kivi4", {"mem_fraction_static": 0.8}, 3.3)]), day=28)
    table = table_of(tmp_path)
    kivi4 = table.row("kivi4")
    assert kivi4.cell("ppl").missing and kivi4.cell("kl_prefill").missing
    assert kivi4.cell("attn").source == "old-attn.json" and not kivi4.cell("capacity").missing
    assert table.row("kivi2").cell("ppl").source == "old.json"  # its defaults did not change
    why = dict(table.skipped)
    assert "kivi4" in why["old.json"] and "kivi4" in why["old-kl.json"] and "old-attn.json" not in why
    write(tmp_path, "new.json", ppl({"auto": 20.0, "kivi4": 20.3}), day=30)
    assert table_of(tmp_path).row("kivi4").cell("ppl").source == "new.json"


def test_a_dtypes_defaults_changed_when_its_newest_default_did():
    """kivi4's prefill became paged (formats/kivi.py) and then its values rotated (formats/rotation.py): the table
    reads its engine runs from the later; kivi3's prefill only; zipcache2's defaults never changed. A recipe that
    names a paged prefill changed when recipes began to name it; one that names none, when rotation did."""
    from bench.decision.defaults_history import CHANGES, defaults_changed

    (paged, *_), (rotated, *_), (recipe_paged, *_) = CHANGES
    assert paged < rotated < recipe_paged
    assert defaults_changed("kivi4") == datetime_of(rotated)
    assert defaults_changed("kivi2") == datetime_of(rotated)
    assert defaults_changed("kivi3") == datetime_of(paged)
    assert defaults_changed(RECIPE_ROW + "gemma3-2.6-w234") == datetime_of(recipe_paged)
    assert defaults_changed(RECIPE_ROW + "smollm2-2.5") == datetime_of(rotated)
    assert defaults_changed("zipcache2") is None and defaults_changed(BF16) is None


def datetime_of(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso).timestamp()


def test_needles_count_the_reporting_half_where_trials_say_their_half(tmp_path):
    write(tmp_path, "split.json", niah({"gear2": [("choose", False), ("report", True), ("report", False)]}), day=2)
    write(tmp_path, "old.json", niah({"kivi2": [(None, True), (None, False), (None, False)]}), day=1)
    write(tmp_path, "choose.json", niah({"kivi1": [("choose", True)]}), day=3)
    table = table_of(tmp_path)
    assert (table.row("gear2").cell("needles").text, table.row("gear2").cell("needles").mark) == ("1/2", "")
    assert (table.row("kivi2").cell("needles").text, table.row("kivi2").cell("needles").mark) == ("1/3", OLD_NEEDLES)
    assert table.row("kivi1").cell("needles").missing  # a run of the choosing half reports nothing
    needles = next(g for g in missing(table) if g.kind == "niah")
    assert "kivi2" in needles.dtypes and "gear2" not in needles.dtypes  # pre-split files are measured again


def test_capacity_is_sglangs_default_sizing_at_the_largest_fraction(tmp_path):
    write(tmp_path, "cap.json", capacity([("auto", {"mem_fraction_static": 0.1}, 1.0),
                                          ("kivi2", {"mem_fraction_static": 0.03}, 5.5),
                                          ("kivi2", {"mem_fraction_static": 0.1}, 6.4),
                                          ("kivi4", {"kv_cache_gb": 1}, 3.5)]), day=1)
    table = table_of(tmp_path)
    assert table.row("kivi2").cell("capacity").text == "6.40x" and table.row(BF16).cell("capacity").text == "1.00x"
    assert table.row("kivi4").cell("capacity").missing  # a pinned budget is not SGLang's sizing


def test_attention_error_is_averaged_over_the_newest_files_layers(tmp_path):
    write(tmp_path, "means.json", {**attention([5], {"fp16": [0.0], "gear2": [0.9]}), "layers": []}, day=1)
    write(tmp_path, "all.json", attention([0, 1, 2, 3], {"fp16": [0.0] * 4, "kivi1": [1.0, 2.0, 3.0, 4.0],
                                                         "gear2": [0.1, 0.2, 0.3, 0.4]}), day=2)
    write(tmp_path, "some.json", attention([1, 3], {"fp16": [0.0, 0.0], "kivi4": [0.1, 0.3]}), day=3)
    table = table_of(tmp_path)
    assert table.attention_layers == [1, 3]
    assert table.row("kivi1").cell("attn").text == "3.000" and table.row("kivi4").cell("attn").text == "0.200"
    assert table.row("gear2").cell("attn").text == "0.300"  # all.json is newer than means.json
    write(tmp_path, "all.json", attention([0, 2], {"fp16": [0.0, 0.0], "kivi1": [1.0, 3.0]}), day=2)
    assert table_of(tmp_path).row("kivi1").cell("attn").mark == OTHER_LAYERS  # no values on layers 1 and 3


def test_kl_kit_numbers_and_the_kits_threshold(tmp_path):
    write(tmp_path, "conf.json", conformance({"bf16": (0.0009, 0.0008), "kivi2": (0.0024, 0.0019)}), day=1)
    table = table_of(tmp_path)
    kivi2 = table.row("kivi2")
    assert (kivi2.cell("kl_prefill").text, kivi2.cell("kl_prefill").mark) == ("0.0024", OVER_KIT)
    assert kivi2.cell("kl_decode").mark == "" and table.row(BF16).cell("kl_decode").text == "0.0008"


def test_the_readme_front_leaves_host_tier_dtypes_apart(tmp_path):
    """specache1's device bytes are kivi1's, but it keeps every token in 16 bits in host RAM too: it is listed after
    the front and beats no device-only dtype off it."""
    write(tmp_path, "ppl.json", ppl({"auto": 20.0, "kivi2": 26.0, "kivi4": 20.2, "specache1": 19.9, "gear2": 27.0}),
          day=30)
    table = table_of(tmp_path)
    assert fronts(table)["ppl_delta"] == ["kivi2", "kivi4", "bf16"]  # the docs' front column and the plot's line too
    block = render.readme_block(table)
    rows = [line.split(" | ")[0].strip("| ") for line in block.splitlines() if line.startswith("| `")]
    assert rows == ["`kivi2`", "`kivi4`", "`specache1`"]
    assert "2,160 + 23,040 host" in block and "`gear2`" in block.split("Not on the front")[1]


def test_pareto_front_of_a_known_set():
    points = {"a": (1.0, 9.0), "b": (2.0, 5.0), "c": (2.0, 6.0), "d": (3.0, 5.0), "e": (4.0, 1.0), "f": (5.0, 1.0),
              "g": (6.0, 0.0), "h": (1.0, 9.0)}
    assert pareto_front(points) == ["a", "h", "b", "e", "g"]  # c, d and f are beaten; a and h tie
    assert pareto_front({"only": (1.0, 1.0)}) == ["only"]


def test_bytes_per_token_are_the_layouts_at_the_defaults(monkeypatch):
    monkeypatch.setenv("KVQ_ZIPCACHE_SALIENT", "0.9")  # a knob set in the shell changes no bytes of the table
    table = collect([])
    got = {r.dtype: r.cell("bytes").text for r in table.rows}
    assert got[BF16] == "23,040" and got["kivi2"] == "3,600" and got["kivi3"] == "5,040"
    assert got["zipcache2"] == "6,663" and got["peer_tq3"] == "4,860" and got["peer_fp8_e4m3"] == "11,520"
    assert got["specache2"] == "3,600 + 23,040 host"


def test_attention_methods_store_the_served_layouts_bytes():
    """Each served dtype's method in bench.eval.attention stores what the pool does per token (the peers' and
    KIVI's, without KIVI's fp16 window), so the attention column measures the dtype it names."""
    import torch

    from bench.decision.cells import bytes_cell
    from bench.decision.models import MODELS
    from bench.eval.attention import DTYPE_METHODS, ByLayer, methods
    from bench.quant.accounting import bits_per_element
    from sgl_kvq.recipe import load_recipe

    table = methods(residual=0)
    torch.manual_seed(0)
    q, k, v = torch.randn(256, 9, 64), torch.randn(256, 3, 64), torch.randn(256, 3, 64)
    for dtype, method in DTYPE_METHODS.items():
        assert method in table, dtype
        if isinstance(table[method], ByLayer):  # a recipe: each layer at its widths, on its model's KV shape
            m = load_recipe(dtype.partition("=")[2]).model
            qr, kr, vr = torch.randn(3, 64, m.kv_heads, m.head_dim)  # one page
            bits = [bits_per_element(table[method].at(i)(kr, vr, qr, 0.125)).total for i in range(m.layers)]
            model = next(x for x in MODELS.values() if x.shape.layers == m.layers and x.shape.head_dim == m.head_dim)
            assert sum(bits) * 2 * m.kv_heads * m.head_dim / 8 == pytest.approx(bytes_cell(dtype, model).value), dtype
        elif dtype.startswith(("peer_", "kivi")):
            bits = bits_per_element(table[method](k, v, q, 0.125)).total
            # nvfp4's method also counts a global scale per layer (fp32 each for K and V: 0.94 B per token over
            # these 256 tokens), which the served format holds at 1.0 and does not store
            assert bits * 2 * 3 * 64 * 30 / 8 == pytest.approx(bytes_cell(dtype).value, abs=1.0), dtype


def test_run_measures_only_the_missing_evals_of_the_requested_dtypes(tmp_path, monkeypatch):
    write(tmp_path, "ppl.json", ppl({"auto": 20.0, "kivi2": 25.0, "kivi1": 20.1}), day=1)
    table = table_of(tmp_path)
    runs = bench_decision.planned_runs(table, {"kivi2", "kivi1", "kivi3"}, "STAMP")
    kinds = {argv[2]: argv for argv in runs}
    assert set(kinds) == {"attention", "niah", "agree", "ppl"}
    assert kinds["ppl"][kinds["ppl"].index("--kv-cache-dtype") + 1] == "auto,kivi3"  # bf16 in the same file
    from bench.eval.attention import DTYPE_METHODS

    want = ",".join(DTYPE_METHODS[d] for d in ("kivi1", "kivi2", "kivi3"))
    assert kinds["attention"][kinds["attention"].index("--methods") + 1] == want
    assert all(a[a.index("--json") + 1] == f"bench/results/quality/{a[2]}-STAMP-smollm2.json" for a in runs)
    assert [a[2] for a in bench_decision.planned_runs(table, {"kivi3"}, "STAMP", ["agree"])] == ["agree"]
    with pytest.raises(SystemExit, match="capacity"):
        bench_decision.planned_runs(table, None, "STAMP", ["capacity"])  # printed for a person, never started
    monkeypatch.setenv("KVQ_TOPK", "256")
    monkeypatch.setenv("KVQ_CPU_KERNEL", "0")
    env = bench_decision.default_knob_env()
    assert "KVQ_TOPK" not in env and env["KVQ_CPU_KERNEL"] == "0"


def test_run_then_regenerates_from_what_it_wrote(tmp_path, monkeypatch):
    inputs = tmp_path / "results"
    inputs.mkdir()
    write(inputs, "ppl.json", ppl({"auto": 20.0, "kivi2": 25.0}), day=1)
    monkeypatch.setattr(bench_decision, "ROOT", tmp_path)
    started = []

    def fake_eval(argv):  # what `sgl-kvq eval ppl` would write: kivi4's row beside bf16's
        started.append(argv)
        if argv[2] == "ppl":
            out = tmp_path / argv[argv.index("--json") + 1]
            out.parent.mkdir(parents=True, exist_ok=True)
            write(out.parent, out.name, ppl({"auto": 20.0, "kivi4": 20.2}), day=30)  # since kivi4's defaults
        return 0

    monkeypatch.setattr(bench_decision, "run_eval", fake_eval)
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{render.README_BEGIN}\n{render.README_END}\n")
    args = bench_decision_args(tmp_path, inputs, readme, run=True, dtypes="kivi4")
    assert bench_decision.run(args) == 0
    assert [a[2] for a in started] == ["attention", "ppl", "niah", "agree"]
    assert all("kivi4" in a[a.index("--json") - 1] for a in started)
    assert "| `kivi4` | 6,480 | — | +1.0% | — |" in readme.read_text()
    assert (tmp_path / "docs" / "decision.md").exists() and (tmp_path / "plot.png").stat().st_size > 0


def bench_decision_args(root: Path, inputs: Path, readme: Path, run: bool = False, dtypes: str = "",
                        check: bool = False):
    import argparse

    p = argparse.ArgumentParser()
    bench_decision.add_arguments(p)
    argv = ["--model", "smollm2", "--inputs", str(inputs), "--docs", str(root / "docs" / "decision.md"),
            "--plot", str(root / "plot.png"),
            "--readme", str(readme), *["--run"] * run, *["--kv-cache-dtype", dtypes] * bool(dtypes),
            *["--check"] * check]
    return p.parse_args(argv)


def test_check_says_whether_the_outputs_are_current(tmp_path):
    write(tmp_path, "ppl.json", ppl({"auto": 20.0, "kivi2": 25.0}), day=1)
    readme = tmp_path / "README.md"
    readme.write_text(f"{render.README_BEGIN}\nold\n{render.README_END}\n")
    assert bench_decision.run(bench_decision_args(tmp_path, tmp_path, readme, check=True)) == 1
    assert bench_decision.run(bench_decision_args(tmp_path, tmp_path, readme)) == 0
    assert bench_decision.run(bench_decision_args(tmp_path, tmp_path, readme, check=True)) == 0


@pytest.mark.parametrize("model", list(MODELS.values()), ids=list(MODELS))
def test_readme_block_is_what_the_committed_results_give(model):
    """The README's summaries cannot go stale: regenerate with `sgl-kvq bench decision` after adding results."""
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: the committed files' dates come from their commits")
    if sources.shallow_history(ROOT):
        pytest.skip("a shallow clone: which committed file is newest is not known")
    table = bench_decision.build(bench_decision.input_paths(None), model)
    assert render.current_block((ROOT / "README.md").read_text(), model) == render.readme_block(table)
    assert (ROOT / model.docs).read_text() == render.docs(table)


def test_a_file_without_a_model_field_is_read_by_its_commands_model():
    """bench conformance wrote no "model" before; its --model must still keep another model's rows out of the table."""
    from bench.decision.sources import other_model

    assert other_model({"command": "sgl-kvq bench conformance --model gemma3 --dtypes kivi4"}, SMOLLM2) == "gemma3"
    assert other_model({"command": "sgl-kvq bench conformance --model smollm2 --dtypes kivi4"}, SMOLLM2) is None
    assert other_model({"command": "sgl-kvq bench conformance --dtypes kivi4"}, SMOLLM2) is None  # the default
    assert other_model({"command": "sgl-kvq bench conformance --dtypes kivi4"}, GEMMA3) == "smollm2"
    assert other_model({"model": "gemma3", "command": "--model smollm2"}, SMOLLM2) == "gemma3"  # the field first


def test_a_recorded_model_folder_names_its_model():
    from bench.decision.sources import other_model

    assert other_model({"model": "/root/.cache/sgl_kvq/models/gemma-3-270m"}, GEMMA3) is None
    assert other_model({"model": "/root/.cache/sgl_kvq/models/gemma-3-270m"}, SMOLLM2) is not None
    assert other_model({"model": "/cache/smollm2-135m-instruct"}, SMOLLM2) is None
    tiny = "/root/.cache/sgl_kvq/models/tiny-gemma3-float32-w24-sf"  # a test model is neither table's
    assert other_model({"model": tiny}, GEMMA3) == tiny and other_model({"model": tiny}, SMOLLM2) == tiny


def gemma(doc: dict) -> dict:
    return {**doc, "model": "/root/.cache/sgl_kvq/models/gemma-3-270m", "command": doc["command"] + " --model gemma3"}


def test_each_model_has_its_own_table_page_figure_and_readme_block(tmp_path, monkeypatch):
    inputs = tmp_path / "results"
    inputs.mkdir()
    write(inputs, "ppl-smollm2.json", ppl({"auto": 20.0, "kivi2": 25.0}), day=1)
    write(inputs, "ppl-gemma3.json", gemma(ppl({"auto": 30.0, "kivi2": 33.0})), day=2)
    found, skipped = sources.load(sources.discover(inputs), inputs, GEMMA3)
    table = collect(found, skipped, GEMMA3)
    assert table.row("kivi2").cell("ppl_delta").text == "+10.0%"
    assert [label for label, _ in table.skipped] == ["ppl-smollm2.json"]
    # Gemma 3 270M's bytes: 18 layers of 1 KV head of 256 channels, every layer storing every token
    assert table.row(BF16).cell("bytes").text == "18,432" and table.row("kivi2").cell("bytes").text == "2,880"
    niah_run = next(m for m in missing(table) if m.kind == "niah")
    assert command("niah", niah_run.dtypes, table)[3:5] == ["--model", "gemma3"]
    assert "--model" not in command("niah", ("kivi2",), table_of(inputs))  # SmolLM2: every command's default
    readme = tmp_path / "README.md"
    readme.write_text("".join(f"{b}\nold\n{e}\n" for b, e in (render.markers(m) for m in MODELS.values())))
    import argparse

    p = argparse.ArgumentParser()
    bench_decision.add_arguments(p)
    monkeypatch.setattr(bench_decision, "ROOT", tmp_path)
    assert bench_decision.run(p.parse_args(["--inputs", str(inputs), "--readme", str(readme)])) == 0  # --model all
    for m in MODELS.values():
        assert (tmp_path / m.docs).read_text().startswith(f"# Which KV cache dtype: quality per byte ({m.title})")
        assert (tmp_path / m.plot).stat().st_size > 0
    text = readme.read_text()
    assert "old" not in text and "| +10.0% |" in text and "| +25.0% |" in text
    with pytest.raises(SystemExit, match="--model"):
        bench_decision.run(p.parse_args(["--inputs", str(inputs), "--docs", str(tmp_path / "x.md")]))


def test_a_shipped_recipe_is_a_row_of_its_model_and_its_entries_name_it(tmp_path):
    """kivimix with each shipped recipe made for the table's model is a row named as the evaluations take it; a run
    of `kivimix:KVQ_RECIPE=NAME` entries beside defaults is read (the recipe names the row, it is not a knob), one
    that sets another knob is not."""
    row = RECIPE_ROW + "smollm2-3.0"
    entries = f"auto,kivi3,{row}"
    write(tmp_path, "recipes.json", ppl({"auto": 20.0, "kivi3": 21.0, row: 20.5},
                                        command=f"sgl-kvq eval ppl --kv-cache-dtype {entries}"), day=1)
    write(tmp_path, "knob.json", ppl({"auto": 20.0, row: 30.0},
                                     command=f"KVQ_ROTATE=none sgl-kvq eval ppl --kv-cache-dtype {entries}"), day=2)
    table = table_of(tmp_path)
    assert table.row(row).cell("bytes").text == "5,040" and table.row(row).cell("ppl_delta").text == "+2.5%"
    assert table.row("kivi3").cell("ppl").source == "recipes.json"
    assert {RECIPE_ROW + f"smollm2-{t}" for t in ("2.5", "3.0", "3.25")} <= {r.dtype for r in table.rows}
    assert not any(r.dtype.startswith(RECIPE_ROW + "smollm2") for r in collect([], [], GEMMA3).rows)  # not its model
