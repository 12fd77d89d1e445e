"""`sgl-kvq bench kernels [-- ARGS...]`: run bench/kernels.py from the repository checkout with ARGS.

bench/ is not a package (it is not installed with the wheel), so this works from a checkout or an editable
install only, and says so otherwise.
"""

from __future__ import annotations

import argparse
import runpy
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "kernels.py"


def add_arguments(p) -> None:
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for bench/kernels.py, after --")


def run(args) -> int:
    if not SCRIPT.is_file():
        print(f"sgl-kvq bench kernels: {SCRIPT} not found; kernel benchmarks run from a repository checkout "
              "(pip install -e . or python bench/kernels.py there)", file=sys.stderr)
        return 2
    saved = sys.argv
    script_args = args.script_args[1:] if args.script_args[:1] == ["--"] else args.script_args
    sys.argv = [str(SCRIPT), *script_args]
    try:
        runpy.run_path(str(SCRIPT), run_name="__main__")
    except SystemExit as e:  # the script's own exit status (argparse errors exit 2)
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    finally:
        sys.argv = saved
    return 0
