"""The layer contract (pyproject.toml's [tool.importlinter], drawn in docs/how-it-works.md "The layers"): sgl_kvq's
layers only point down, no import cycle exists among its modules (type-only imports counted), and the product never
imports its tooling (bench/). Run by import-linter, as `make check` runs it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LINT = Path(sys.executable).with_name("lint-imports")


def lint(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT), "--no-cache", "--config", str(root / "pyproject.toml")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_checkout_keeps_every_contract():
    proc = lint(ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.stdout.count(" KEPT") == 3, proc.stdout[-2000:]


def test_an_upward_type_only_import_breaks_the_layers_and_makes_a_cycle(tmp_path):
    """The check can fail: the layout (a declaration) naming the config for a type annotation only."""
    for name in ("sgl_kvq", "bench", "kernels", "patches"):
        shutil.copytree(ROOT / name, tmp_path / name, symlinks=True,
                        ignore=shutil.ignore_patterns("__pycache__", "results"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    layout = tmp_path / "sgl_kvq" / "layout.py"
    layout.write_text(layout.read_text() + "\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                      "    from sgl_kvq.config import KVQConfig  # noqa: F401\n")
    proc = lint(tmp_path)
    assert proc.returncode != 0
    assert "sgl_kvq's layers only point down BROKEN" in proc.stdout
    assert "no import cycle among sgl_kvq's modules BROKEN" in proc.stdout
    assert "sgl_kvq.layout is not allowed to import sgl_kvq.config" in proc.stdout
