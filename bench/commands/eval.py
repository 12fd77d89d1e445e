"""`sgl-kvq eval <what>`: quality evaluations, one module each (bench/commands/eval_<what>.py)."""

from __future__ import annotations

from bench.commands import _subcommands

EVALUATIONS = {
    "attention": ("bench.commands.eval_attention", "attention output error of each KV method vs bf16"),
    "niah": ("bench.commands.eval_niah", "needle-in-a-haystack retrieval through the server"),
    "longdoc": ("bench.commands.eval_longdoc", "questions about one long cached document (8k-32k tokens)"),
    "ppl": ("bench.commands.eval_ppl", "perplexity on Paul Graham's essays"),
    "agree": ("bench.commands.eval_agree", "greedy-token agreement with the bf16 KV cache"),
}


def add_arguments(p) -> None:
    _subcommands.add_subparsers(p, EVALUATIONS, dest="evaluation")


def run(args) -> int:
    return _subcommands.run(args)
