"""Shared plumbing for `sgl-kvq eval <what>` and `sgl-kvq bench <what>`: one sub-parser per module that exists.

Each evaluation/benchmark is a module with `add_arguments(p)` and `run(args) -> int`. Modules that are not
installed are left out of the parser; the others are imported whenever `sgl-kvq eval`/`bench` runs, so
they keep heavy imports (torch, sglang) inside run().
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys


def available(modules: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """The entries of {name: (module, help)} whose module is installed."""
    return {name: entry for name, entry in modules.items() if importlib.util.find_spec(entry[0]) is not None}


def add_subparsers(p, modules: dict[str, tuple[str, str]], dest: str) -> None:
    found = available(modules)
    missing = sorted(set(modules) - set(found))
    if missing:
        p.epilog = f"not installed in this version: {', '.join(missing)}"
    sub = p.add_subparsers(dest=dest, required=True)
    for name, (module, help_text) in found.items():
        q = sub.add_parser(name, help=help_text, description=help_text)
        q.set_defaults(_sub_module=module)
        importlib.import_module(module).add_arguments(q)


def run(args) -> int:
    return importlib.import_module(args._sub_module).run(args) or 0


def standalone_main(module_name: str, argv: list[str] | None = None) -> int:
    """`python -m bench.commands.<name> ARGS`: one evaluation's parser and run, without the sgl-kvq
    dispatcher."""
    module = sys.modules[module_name]
    name = module.__spec__.name if module.__spec__ else module_name
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog=f"python -m {name}", description=(module.__doc__ or name).splitlines()[0])
    module.add_arguments(p)
    args = p.parse_args(argv)
    args._argv = argv  # recorded in the results as the command that made them
    return module.run(args)
