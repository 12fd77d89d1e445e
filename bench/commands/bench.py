"""`sgl-kvq bench <what>`: `multiturn`, `capacity`, `decode`, `serving`, `conformance`, `soak`, `decision`
(bench/commands/bench_*.py) and `kernels` (bench/kernels.py)."""

from __future__ import annotations

from bench.commands import _subcommands

BENCHMARKS = {
    "multiturn": ("bench.commands.bench_multiturn", "multi-turn ShareGPT clients against a server"),
    "kernels": ("bench.commands.bench_kernels",
                "Triton kernel microbenchmarks (bench/kernels.py, from a checkout)"),
    "capacity": ("bench.commands.bench_capacity",
                 "KV token capacity per dtype at the same KV memory, from servers"),
    "decode": ("bench.commands.bench_decode",
               "decode ms/step and tok/s vs context length per dtype, from servers"),
    "serving": ("bench.commands.bench_serving", "SGLang's load generator against one server per dtype, two KV "
                "budget regimes, several concurrencies"),
    "conformance": ("bench.commands.bench_conformance", "SGLang's own server test kits against bf16 and each "
                    "kvq dtype at the same pinned KV budget (a kvq dtype must pass what bf16 passes)"),
    "soak": ("bench.commands.bench_soak", "concurrent multi-turn load with disconnects, aborts and malformed "
             "requests at a budget that evicts and retracts: errors, replay agreement, leaks, resident memory"),
    "decision": ("bench.commands.bench_decision", "the decision table (docs/decision.md), its Pareto plot and "
                 "the README's summary from the result JSON files; --run measures the missing cells first"),
}


def add_arguments(p) -> None:
    _subcommands.add_subparsers(p, BENCHMARKS, dest="benchmark")


def run(args) -> int:
    return _subcommands.run(args)
