"""A fresh interpreter that loads sgl_kvq as SGLang loads a plugin (pyproject's `sglang.srt.plugins` entry point,
called twice, as each SGLang process may), then imports what a server process imports beside it (the pool, the
attention backends): what it registered and imported, for tests/unit/test_patches.py and
tests/unit/test_product_imports.py. One run per test process (importing SGLang takes 10-25 s on 2 cores)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What a server process imports beside the plugin's load(): the pool SGLang's pool builder constructs and the
# attention backends it registers (each imported by name when a dtype resolves to it).
SERVER_MODULES = ("sgl_kvq.pool", "sgl_kvq.host_pool", "sgl_kvq.pd_transfer", "sgl_kvq.backends.torch_backend",
                  "sgl_kvq.backends.triton_backend", "sgl_kvq.backends.specache_backend",
                  "sgl_kvq.backends.specache_triton_backend")

_SCRIPT = """
import importlib
import json
import sys

from sglang.srt.plugins.hook_registry import HookRegistry

module, attr = sys.argv[1].split(":")
load = getattr(importlib.import_module(module), attr)
load()
after_first = {t: len(h) for t, h in HookRegistry._hooks.items()}
load()
from sgl_kvq import patches

for name in sys.argv[2:]:
    importlib.import_module(name)
hooks = {t: [[kind.name, fn.__module__, fn.__qualname__] for kind, fn, _ in h] for t, h in HookRegistry._hooks.items()}
print(json.dumps({"error": str(patches._state["error"] or ""), "hooks": hooks, "after_first_load": after_first,
                  "modules": sorted(sys.modules)}))
"""


def entry_point() -> str:
    """pyproject's `sglang.srt.plugins` entry for sgl_kvq, `module:function`."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["entry-points"]["sglang.srt.plugins"]["sgl_kvq"]


@functools.lru_cache(maxsize=None)
def loaded_plugin() -> dict:
    """{error, hooks: {target: [[HookType name, module, qualname], ...]}, after_first_load: {target: count},
    modules: [every module imported]} of the fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", _SCRIPT, entry_point(), *SERVER_MODULES], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        raise AssertionError(f"loading the plugin failed:\n{run.stderr[-4000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])
