"""The `sgl-kvq` console script and the eval/bench dispatchers (`sgl-kvq model tiny`:
tests/tools/test_models_data.py)."""

from __future__ import annotations

import importlib.machinery
import subprocess
import sys
import types
from pathlib import Path

import pytest

from bench.cli import COMMANDS, main
from bench.commands import _subcommands, bench, bench_kernels, eval as eval_cmd


def _sgl_kvq(venv_bin, *args):
    return subprocess.run([str(venv_bin / "sgl-kvq"), *args], capture_output=True, text=True, timeout=300)


def test_help_lists_every_command(venv_bin):
    out = _sgl_kvq(venv_bin, "--help")
    assert out.returncode == 0, out.stderr
    for name in COMMANDS:
        assert name in out.stdout


def test_eval_help_lists_installed_evaluations_and_names_the_rest(venv_bin):
    out = _sgl_kvq(venv_bin, "eval", "--help")
    assert out.returncode == 0, out.stderr
    usage, _, not_installed = " ".join(out.stdout.split()).partition("not installed in this version:")
    installed = _subcommands.available(eval_cmd.EVALUATIONS)
    for name in eval_cmd.EVALUATIONS:
        assert name in (usage if name in installed else not_installed)


@pytest.fixture
def fake_evaluation(monkeypatch):
    """An evaluation module `fake` that records the arguments it was run with."""
    mod = types.ModuleType("sgl_kvq_test_fake_eval")
    mod.__spec__ = importlib.machinery.ModuleSpec(mod.__name__, None)
    mod.calls = []
    mod.add_arguments = lambda p: p.add_argument("--n", type=int, default=1)
    mod.run = lambda args: mod.calls.append(args.n) or 7
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setitem(eval_cmd.EVALUATIONS, "fake", (mod.__name__, "a fake evaluation"))
    monkeypatch.setitem(eval_cmd.EVALUATIONS, "absent", ("sgl_kvq_test_no_such_module", "not installed"))
    return mod


def test_eval_routes_to_its_module(fake_evaluation, capsys):
    assert main(["eval", "fake", "--n", "3"]) == 7
    assert fake_evaluation.calls == [3]
    with pytest.raises(SystemExit) as e:  # modules that are not installed get no sub-command
        main(["eval", "absent"])
    assert e.value.code == 2
    assert "invalid choice: 'absent'" in capsys.readouterr().err


def test_bench_kernels_runs_the_checkout_script(tmp_path, monkeypatch):
    script = tmp_path / "kernels.py"
    script.write_text("import sys\n(OUT := open(sys.argv[-1], 'w')).write(' '.join(sys.argv[1:-1]))\n"
                      "sys.exit(3 if '--fail' in sys.argv else 0)\n")
    monkeypatch.setattr(bench_kernels, "SCRIPT", script)
    record = tmp_path / "args.txt"
    assert main(["bench", "kernels", "--", "--iters", "5", str(record)]) == 0
    assert record.read_text() == "--iters 5"
    assert main(["bench", "kernels", "--", "--fail", str(record)]) == 3
    assert "kernels" in bench.BENCHMARKS


def test_bench_kernels_finds_the_checkouts_script():
    assert bench_kernels.SCRIPT == Path(__file__).resolve().parents[2] / "bench" / "kernels.py"
    assert bench_kernels.SCRIPT.is_file()


def test_bench_kernels_outside_a_checkout_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench_kernels, "SCRIPT", tmp_path / "bench" / "kernels.py")
    assert main(["bench", "kernels"]) == 2
    assert "repository checkout" in capsys.readouterr().err
