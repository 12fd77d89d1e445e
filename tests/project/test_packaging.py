"""The wheel ships kernels/ and patches/ as sgl_kvq.kernels / sgl_kvq.patches, the sgl_kvq.specache package and its
modules, the plugin entry point and the console script, and they work from a clean install (nothing from this
checkout on the path)."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

PURELIB = sysconfig.get_paths()["purelib"]
_SOURCES = ["pyproject.toml", "README.md", "sgl_kvq", "kernels", "patches", "bench"]

_IMPORT_CHECK = r"""
import sys, importlib, importlib.metadata as md
target = sys.argv[1]
for name in ("sgl_kvq", "sgl_kvq.kernels", "sgl_kvq.patches", "bench.cli", *sys.argv[2:]):
    m = importlib.import_module(name)
    assert m.__file__.startswith(target), (name, m.__file__)
dist = next(md.distributions(name="sgl-kvq", path=[target]))
(ep,) = [ep for ep in dist.entry_points if ep.group == "sglang.srt.plugins"]
load = ep.load()
assert callable(load) and load.__module__ == "sgl_kvq.patches", ep
print("ok")
"""


def _build_wheel(src: Path, out: Path) -> Path:
    # without PYTHONPATH: a checkout on it puts its top-level kernels/ before the installed `kernels` distribution,
    # whose egg_info.writers entry point (kernels.lockfile) setuptools loads while building the metadata
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)], check=True, capture_output=True, text=True, env=env)
    (wheel,) = out.glob("sgl_kvq-*.whl")
    return wheel


def _copy_sources(root: Path, dst: Path) -> Path:
    """The package sources alone (symlinks kept, as in a clone), so the build leaves the checkout untouched."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in _SOURCES:
        s = root / name
        if s.is_dir():
            shutil.copytree(s, dst / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", ".hypothesis", "results"))
        else:
            shutil.copy2(s, dst / name)
    return dst


def wheel_problems(wheel: Path, root: Path, target: Path) -> list[str]:
    """Everything wrong with `wheel` as a clean install (empty when it is right)."""
    problems = []
    names = set(zipfile.ZipFile(wheel).namelist())
    for top in ("kernels", "patches"):
        for f in sorted([*(root / top).rglob("*.py"), *(root / top).rglob("*.c")]):  # .c: the CPU kernel's source
            if "__pycache__" not in f.parts:
                rel = f"sgl_kvq/{top}/{f.relative_to(root / top).as_posix()}"
                if rel not in names:
                    problems.append(f"{rel} missing from the wheel")
    for f in sorted((root / "sgl_kvq" / "recipes").glob("*.json")):  # the recipes KVQ_RECIPE names
        if f"sgl_kvq/recipes/{f.name}" not in names:
            problems.append(f"sgl_kvq/recipes/{f.name} missing from the wheel")
    (ep_txt,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    eps = configparser.ConfigParser()
    eps.read_string(zipfile.ZipFile(wheel).read(ep_txt).decode())
    if eps.get("sglang.srt.plugins", "sgl_kvq", fallback=None) != "sgl_kvq.patches:load":
        problems.append("entry point sglang.srt.plugins: sgl_kvq = sgl_kvq.patches:load not declared")
    if eps.get("console_scripts", "sgl-kvq", fallback=None) != "bench.cli:main":
        problems.append("console script sgl-kvq not declared")

    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, text=True)
    # -S: no site-packages .pth files (the editable install of this checkout would answer for missing modules);
    # the venv's packages (torch, triton, sglang) come AFTER the install, then the wheel's own CPU shims.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), PURELIB, str(target / "sgl_kvq" / "cpu_shims")])}
    # a regular package (a namespace package has no __file__), and every module of it
    specache = ["sgl_kvq.specache"] + sorted(f"sgl_kvq.specache.{f.stem}"
                                             for f in (root / "sgl_kvq" / "specache").glob("[!_]*.py"))
    run = subprocess.run([sys.executable, "-S", "-c", _IMPORT_CHECK, str(target), *specache], env=env,
                         cwd=target.parent, capture_output=True, text=True, timeout=300)
    if run.returncode != 0:
        problems.append(f"clean import failed: {run.stderr.strip().splitlines()[-1:]}")
    script = target / "bin" / "sgl-kvq"
    if not (script.is_file() and os.access(script, os.X_OK)):
        problems.append("bin/sgl-kvq not installed")
    else:
        run = subprocess.run([sys.executable, "-S", str(script), "--help"], env=env, cwd=target.parent,
                             capture_output=True, text=True, timeout=300)
        if run.returncode != 0 or "usage: sgl-kvq" not in run.stdout:
            problems.append(f"sgl-kvq --help from the install failed: {run.stderr.strip().splitlines()[-1:]}")
    return problems


@pytest.fixture(scope="module")
def built_wheel(repo_root, tmp_path_factory) -> Path:
    src = _copy_sources(repo_root, tmp_path_factory.mktemp("src"))
    return _build_wheel(src, tmp_path_factory.mktemp("dist"))


def test_wheel_installs_kernels_patches_entry_point_and_script(built_wheel, repo_root, tmp_path):
    assert wheel_problems(built_wheel, repo_root, tmp_path / "site") == []


def test_the_check_catches_a_wheel_without_kernels_and_patches(repo_root, tmp_path):
    src = _copy_sources(repo_root, tmp_path / "src")
    (src / "sgl_kvq" / "kernels").unlink()  # the symlinks that make kernels/ and patches/ part of the package
    (src / "sgl_kvq" / "patches").unlink()
    problems = wheel_problems(_build_wheel(src, tmp_path / "dist"), repo_root, tmp_path / "site")
    assert "sgl_kvq/kernels/__init__.py missing from the wheel" in problems
    assert "sgl_kvq/patches/__init__.py missing from the wheel" in problems
    assert any(p.startswith("clean import failed") for p in problems)
