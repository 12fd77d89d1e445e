"""Which cells of the decision table no file holds, and the existing command that measures each group of them."""

from __future__ import annotations

from dataclasses import dataclass

from bench.decision.cells import BF16, OLD_NEEDLES, OTHER_LAYERS, Table
from bench.decision.models import UNRECORDED

# The kinds `sgl-kvq bench decision --run` measures itself: `sgl-kvq eval`, one engine per dtype at most. Capacity
# (a server per dtype and budget) and the KL kit (a conformance run) are printed for a person to run.
EVAL_KINDS = ("attention", "ppl", "niah", "agree")
DEFAULT_JSON = {"capacity": "bench/results/capacity-decision-{model}.json",
                "attention": "bench/results/quality/attention-decision-{model}.json",
                "ppl": "bench/results/quality/ppl-decision-{model}.json",
                "niah": "bench/results/quality/niah-decision-{model}.json",
                "agree": "bench/results/quality/agree-decision-{model}.json",
                "conformance": "bench/results/conformance-kl-decision-{model}.json"}
NO_METHOD = "no `sgl-kvq eval attention` method models SpeCache's decode (the exact rows its second lane picks)"


@dataclass(frozen=True)
class Missing:
    kind: str  # the result kind that would hold the cells (bench.decision.sources.kind_of)
    what: str
    dtypes: tuple[str, ...]
    measurable: bool = True  # False: no command measures them (NO_METHOD)


def _lacking(table: Table, columns: tuple[str, ...], marks: tuple[str, ...] = ()) -> tuple[str, ...]:
    return tuple(r.dtype for r in table.rows
                 if any(r.cell(c).missing or (r.cell(c).mark and r.cell(c).mark in marks) for c in columns))


def missing(table: Table) -> list[Missing]:
    from bench.eval.attention import DTYPE_METHODS

    attn = _lacking(table, ("attn",), (OTHER_LAYERS,))
    out = [Missing("capacity", "tokens x bf16", _lacking(table, ("capacity",))),
           Missing("attention", "attention error", tuple(d for d in attn if d in DTYPE_METHODS)),
           Missing("attention", "attention error", tuple(d for d in attn if d not in DTYPE_METHODS and d != BF16),
                   measurable=False),
           Missing("ppl", "ppl and ppl vs bf16 (one run with bf16)", _lacking(table, ("ppl_delta",))),
           Missing("niah", f"needles (the reporting half; {OLD_NEEDLES}: measured before the split)",
                   _lacking(table, ("needles",), (OLD_NEEDLES,))),
           Missing("agree", "greedy agreement", _lacking(table, ("agree",))),
           Missing("conformance", "KL kit", _lacking(table, ("kl_prefill", "kl_decode")))]
    return [m for m in out if m.dtypes]


def _with_bf16(dtypes) -> str:
    """The dtypes as the evaluations take them, bf16 ("auto") first: their delta or baseline is bf16 in the same
    run."""
    return ",".join(["auto"] + [d for d in dtypes if d != BF16])


def command(kind: str, dtypes, table: Table, json_path: str | None = None) -> list[str]:
    """The argv (from `sgl-kvq`) that measures `dtypes` for `kind`, writing `json_path`."""
    from bench.eval.attention import DTYPE_METHODS

    name = table.model.name
    out = json_path or DEFAULT_JSON[kind].format(model=name)
    kvq = [d for d in dtypes if d != BF16]
    model = [] if name == UNRECORDED else ["--model", name]  # the commands' default needs no flag
    if kind == "capacity":
        return ["sgl-kvq", "bench", "capacity", *model, "--kv-cache-dtype", _with_bf16(dtypes),
                "--mem-fraction-static", "0.1", "--kv-cache-gb", "", "--burst", "0", "--json", out]
    if kind == "attention":
        layers = ["--layers", ",".join(map(str, table.attention_layers))] if table.attention_layers else []
        return ["sgl-kvq", "eval", "attention", *model, *layers, "--methods",
                ",".join(DTYPE_METHODS[d] for d in kvq), "--json", out]
    if kind == "ppl":
        return ["sgl-kvq", "eval", "ppl", *model, "--kv-cache-dtype", _with_bf16(dtypes), "--json", out]
    if kind == "niah":  # bf16 on the same needles: what every dtype's misses are read against
        return ["sgl-kvq", "eval", "niah", *model, "--needle-set", "report", "--kv-cache-dtype", _with_bf16(dtypes),
                "--json", out]
    if kind == "agree":  # bf16 is the reference of every run; listed, it is a second bf16 engine's self-check
        return ["sgl-kvq", "eval", "agree", *model, "--kv-cache-dtype", ",".join(["auto"] * (BF16 in dtypes) + kvq),
                "--json", out]
    if kind == "conformance":  # bf16 runs first in every conformance run, as the baseline
        return ["sgl-kvq", "bench", "conformance", "--model", name, "--dtypes", ",".join(kvq or ["kivi4"]),
                "--groups", "kits", "--kits", "kl_divergence", "--json", out]
    raise ValueError(f"no command measures {kind!r}")
