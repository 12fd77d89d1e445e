"""`sgl-kvq serve ARGS...`: SGLang's launch_server with ARGS; without a GPU the CPU engine settings are added
(bench/launch.py: server_argv), so the same command serves on a laptop and on a GPU box. With --tp-size or
--dp-size above 1 on the CPU engine it also sets the OpenMP thread binding SGLang requires (or checks the user's)."""

from __future__ import annotations

import os
import sys


def add_arguments(p) -> None:
    p.add_argument("args", nargs="*", help="arguments for python -m sglang.launch_server")


def run(args) -> int:
    return run_raw(args.args)


def run_raw(argv: list[str]) -> int:
    from sgl_kvq.cpu_engine import ThreadBindError
    from bench.launch import server_argv

    try:
        full = server_argv(argv)
    except ThreadBindError as e:
        print(f"sgl-kvq serve: {e}", file=sys.stderr)
        return 2
    # exec: launch_server owns signals and its child processes, exactly as when started by hand.
    os.execv(sys.executable, [sys.executable, "-m", "sglang.launch_server", *full])
    return 0  # not reached
