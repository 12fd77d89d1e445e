"""`sgl-kvq eval <what>`: quality evaluations, one module each (sgl_kvq/tools/commands/eval_<what>.py)."""

from __future__ import annotations

from sgl_kvq.tools.commands import _subcommands

EVALUATIONS = {
    "attention": ("sgl_kvq.tools.commands.eval_attention", "attention output error of each KV method vs bf16"),
    "niah": ("sgl_kvq.tools.commands.eval_niah", "needle-in-a-haystack retrieval through the server"),
    "ppl": ("sgl_kvq.tools.commands.eval_ppl", "perplexity on Paul Graham's essays"),
    "agree": ("sgl_kvq.tools.commands.eval_agree", "greedy-token agreement with the bf16 KV cache"),
}


def add_arguments(p) -> None:
    _subcommands.add_subparsers(p, EVALUATIONS, dest="evaluation")


def run(args) -> int:
    return _subcommands.run(args)
