"""`sgl-kvq bench decision`: the decision table of each model (docs/decision.md for SmolLM2-135M,
docs/decision-gemma3.md for Gemma 3 270M), its figure (bench/results/decision-<model>.png) and its summary in the
README, from the result JSON files the other commands wrote on that model (bench/decision/).

Without --run it reads files and writes a page, a figure and a README block per model; it starts no engine. With
--run it first runs the `sgl-kvq eval` commands (attention, ppl, niah, agree) that measure the missing cells of the
requested dtypes on the model, every knob at its default (KVQ_ knobs that change a dtype are removed from their
environment), writing under bench/results/quality/, then regenerates from everything.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def add_arguments(p) -> None:
    from bench.decision.models import MODELS

    p.add_argument("--model", choices=[*MODELS, "all"], default="all",
                   help="the model whose table to make (default all: " + ", ".join(MODELS) + ")")
    p.add_argument("--inputs", nargs="+", type=Path, metavar="PATH",
                   help="result JSON files or folders to read (default: every JSON under bench/results)")
    p.add_argument("--docs", type=Path, help="the table's page (default the model's: "
                   + ", ".join(m.docs for m in MODELS.values()) + "); with one --model only")
    p.add_argument("--plot", type=Path, help="the figure (default the model's: "
                   + ", ".join(m.plot for m in MODELS.values()) + "); with one --model only")
    p.add_argument("--readme", default=str(ROOT / "README.md"),
                   help="README whose summary block is rewritten (default README.md; '' for none)")
    p.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 where the page or the README's block differ from what the inputs give")
    p.add_argument("--run", action="store_true",
                   help="first run the `sgl-kvq eval` commands that measure the missing cells (engines: minutes each)")
    p.add_argument("--kv-cache-dtype", default="",
                   help="--run: comma list of the dtypes to measure (default: every dtype with a missing cell)")
    p.add_argument("--evals", default="attention,ppl,niah,agree",
                   help="--run: comma list of the evaluations to run where cells are missing (default: all four)")


def input_paths(inputs: list[Path] | None) -> list[Path]:
    from bench.decision.sources import discover

    if not inputs:
        return discover(ROOT / "bench" / "results")
    return sorted({f for p in inputs for f in (discover(p) if p.is_dir() else [p])})


def build(paths: list[Path], model=None):
    """`model`'s table (default SmolLM2's) from the files in `paths` that ran on it."""
    from bench.decision.cells import collect
    from bench.decision.models import SMOLLM2
    from bench.decision.sources import load

    model = model or SMOLLM2
    sources, skipped = load(paths, ROOT, model)
    return collect(sources, skipped, model)


def planned_runs(table, wanted: set[str] | None, stamp: str, evals=None) -> list[list[str]]:
    """The `sgl-kvq eval` argvs --run starts: one per evaluation (of `evals`, default all) with missing cells among
    `wanted` (None: all), each writing bench/results/quality/<kind>-<stamp>-<model>.json."""
    from bench.decision.missing import EVAL_KINDS, command, missing

    unknown = set(evals or ()) - set(EVAL_KINDS)
    if unknown:
        raise SystemExit(f"sgl-kvq bench decision: --evals {','.join(sorted(unknown))}: not one of "
                         f"{','.join(EVAL_KINDS)}")
    runs = []
    for gap in missing(table):
        dtypes = [d for d in gap.dtypes if wanted is None or d in wanted]
        if gap.kind in (evals or EVAL_KINDS) and gap.measurable and dtypes:
            runs.append(command(gap.kind, dtypes, table,
                                f"bench/results/quality/{gap.kind}-{stamp}-{table.model.name}.json"))
    return runs


def default_knob_env() -> dict[str, str]:
    """This process's environment without the KVQ_ knobs that change what a dtype stores or reads."""
    from bench.decision.sources import dtype_knobs

    changing = dtype_knobs()
    return {k: v for k, v in os.environ.items() if k not in changing}


def run_eval(argv: list[str]) -> int:
    """One `sgl-kvq ...` argv in a child process at the repository root."""
    print(f"running: {shlex.join(argv)}", flush=True)
    return subprocess.call([sys.executable, "-m", "bench.cli", *argv[1:]], cwd=ROOT, env=default_knob_env())


def run(args) -> int:
    from bench.decision.models import MODELS

    models = list(MODELS.values()) if args.model == "all" else [MODELS[args.model]]
    if len(models) > 1 and (args.docs or args.plot):
        raise SystemExit("sgl-kvq bench decision: --docs and --plot name one model's files; give --model too")
    return max(run_model(args, model) for model in models)


def run_model(args, model) -> int:
    """One model's table: --run's evaluations, then its page, figure and README block (or --check of them)."""
    from bench.decision import render

    docs_path = args.docs or ROOT / model.docs
    plot_path = args.plot or ROOT / model.plot
    paths = input_paths(args.inputs)
    table = build(paths, model)
    if args.run:
        wanted = {d.strip() for d in args.kv_cache_dtype.split(",") if d.strip()} or None
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        evals = [e.strip() for e in args.evals.split(",") if e.strip()]
        for argv in planned_runs(table, wanted, stamp, evals):
            out = ROOT / argv[argv.index("--json") + 1]
            if run_eval(argv) != 0:
                print(f"sgl-kvq bench decision: {shlex.join(argv)} failed; its cells stay missing", file=sys.stderr)
            if out.exists() and args.inputs:  # the default inputs find it under bench/results
                paths = sorted({*paths, out})
        table = build(input_paths(None) if not args.inputs else paths, model)
    page = render.docs(table)
    block = render.readme_block(table)
    readme = Path(args.readme) if args.readme else None
    if args.check:
        stale = [str(docs_path)] * (not docs_path.exists() or docs_path.read_text() != page)
        if readme is not None and render.current_block(readme.read_text(), model) != block:
            stale.append(f"{readme}'s {model.name} decision block")
        for what in stale:
            print(f"stale: {what} (run sgl-kvq bench decision)")
        if not stale:
            print(f"current: {docs_path}" + (f" and {readme}'s {model.name} decision block" if readme else ""))
        return 1 if stale else 0
    docs_path.parent.mkdir(parents=True, exist_ok=True)
    docs_path.write_text(page)
    if readme is not None:
        readme.write_text(render.replace_block(readme.read_text(), block, model))
    from bench.decision.plot import plot

    plot_path.parent.mkdir(parents=True, exist_ok=True)
    wrote = plot(table, plot_path) is not None
    print(f"wrote {docs_path}" + (f", {readme}'s block" if readme else "") + (f", {plot_path}" if wrote else
                                                                                "; no quality number, no plot"))
    return 0
