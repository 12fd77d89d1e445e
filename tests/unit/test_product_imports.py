"""A server process imports only the product: what SGLang's plugin entry point (pyproject's `sglang.srt.plugins`
entry, `sgl_kvq.patches:load`), the pool and the attention backends import never reaches the tooling
(the top-level `bench` package: the `sgl-kvq` command line, evaluations, benchmarks, soak, launchers, embedded models
and data). Held three times: by the layer contract (pyproject.toml's [tool.importlinter], `make check`), here over
every product module's imports and the strings it may import by name, and in a fresh interpreter that loads the
plugin as SGLang does."""

from __future__ import annotations

import ast
import os
from pathlib import Path

from plugin_process import ROOT, SERVER_MODULES, loaded_plugin

PACKAGE = ROOT / "sgl_kvq"
TOOLING = ("bench",)


def is_tooling(name: str) -> bool:
    return any(name == t or name.startswith(t + ".") for t in TOOLING)


def product_modules() -> dict[str, Path]:
    """Every module of the package (kernels/ and patches/ through their links) but the tooling: name -> file."""
    out = {}
    for folder, dirs, files in os.walk(PACKAGE, followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            if not f.endswith(".py"):
                continue
            parts = (Path(folder) / f).relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            if not is_tooling(name):
                out[name] = Path(folder) / f
    return out


def imported_names(source: str, module: str, is_package: bool = False) -> set[str]:
    """The modules `source` (module `module`) imports: import statements anywhere (function bodies included, so
    lazy imports count), relative ones resolved, `from X import y` as X and X.y, and any string constant naming an
    sgl_kvq or bench module (importlib.import_module targets, f-string prefixes)."""
    package = module if is_package else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and node.value.startswith(("sgl_kvq.", "bench.")):
            names.add(node.value.split(":")[0].rstrip("."))
    return names


def test_the_import_walk_sees_absolute_relative_lazy_and_string_imports():
    """The walk below can fail: each way a module can reach the tooling is found."""
    source = '''
import bench.launch
import bench as tools
from bench import soak


def lazy():
    from bench.cli import main
    importlib.import_module("bench.commands.serve")
'''
    names = imported_names(source, "sgl_kvq.backends.base")
    assert {"bench.launch", "bench", "bench.soak", "bench.cli.main",
            "bench.commands.serve"} <= names
    assert sorted(n for n in names if is_tooling(n)) == sorted(
        ["bench.launch", "bench", "bench.soak", "bench.cli", "bench.cli.main",
         "bench.commands.serve"])


def test_no_product_module_imports_the_tooling():
    modules = product_modules()
    assert {"sgl_kvq.pool", "sgl_kvq.patches.sizing", "sgl_kvq.kernels.decode_attention",
            "sgl_kvq.formats.registry"} <= set(modules), "the walk missed product modules"
    assert not any(is_tooling(m) for m in modules)
    pool = imported_names(modules["sgl_kvq.pool"].read_text(), "sgl_kvq.pool")
    assert "sgl_kvq.kv_store" in pool, "the walk missed the pool's imports"
    bad = []
    for name, path in sorted(modules.items()):
        reached = imported_names(path.read_text(), name, path.name == "__init__.py")
        bad += [f"{path.relative_to(ROOT)}: {n}" for n in sorted(reached) if is_tooling(n)]
    assert bad == [], "product modules import the tooling (bench/):\n" + "\n".join(bad)


def test_a_server_process_loading_the_plugin_imports_no_tooling():
    loaded = set(loaded_plugin()["modules"])
    hooked = {f"sgl_kvq.patches.{m}" for m in ("dtype", "sizing", "pool_build", "frames", "pd", "hicache")}
    assert hooked | set(SERVER_MODULES) <= loaded, "the plugin did not load its hooks"
    assert sorted(m for m in loaded if is_tooling(m)) == []
