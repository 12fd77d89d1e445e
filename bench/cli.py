"""`sgl-kvq model | serve | eval | bench | calibrate | demo`.

Each command lives in its own module under bench/commands/ with `add_arguments(parser)` and `run(args) -> int`;
modules import lazily so `sgl-kvq model smollm2` never pays for importing sglang.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "model": ("bench.commands.model", "materialize an embedded model and print its folder"),
    "serve": ("bench.commands.serve",
              "run SGLang's launch_server with ARGS (CPU engine settings added without a GPU)"),
    "eval": ("bench.commands.eval", "quality evaluations: attention, niah, ppl, agree"),
    "bench": ("bench.commands.bench", "benchmarks: multiturn, kernels"),
    "calibrate": ("bench.commands.calibrate",
                  "per-layer K / V sensitivity to the code width, and the widths that meet a mean --bits"),
    "demo": ("bench.commands.demo",
             "the main job: bf16 vs kivi4 vs kivi2 on a multi-turn ShareGPT workload"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="sgl-kvq", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    if argv and argv[0] == "serve":  # everything after `serve` belongs to launch_server, untouched
        return importlib.import_module(COMMANDS["serve"][0]).run_raw(argv[1:])
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module)
        if name in (argv[:1] or [None]):
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    return importlib.import_module(args._module).run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
