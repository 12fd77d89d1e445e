"""`sgl-kvq eval niah`: needle-in-a-haystack through the engine, the question reading the haystack from the cache.

For each context length and depth: request 1 sends the chat-templated haystack (Paul Graham's essays with the needle
sentence inserted at a sentence boundary near `depth`) with max_new_tokens=1, so its pages enter the radix cache
(quantized under kvq); request 2 sends haystack + question and must report cached_tokens > 0: the question and the
answer then attend to the haystack from the prefix cache. Request 1 carries the overlay-flush tail
(bench/eval/engine_eval.py) so every cached page, the needle's included, is read from the packed base. A trial
is a hit when the key fact appears in the greedy answer (case-insensitive substring).

The assistant turn starts with an answer prefix so a few new tokens suffice (decode is the slow part on CPU).

The needles (bench/eval/needles.py): twelve facts of three kinds (digits, names, phrases) at contexts of 1k-4k
tokens, each (needle, length) at its own depth; `--needle-set choose` is the half that chooses defaults,
`--needle-set report` the half their results are read from, `all` both. `--needle-set single` runs one needle (the
`--needle`, `--question`, `--answer` options) at every `--depths` value.

Standalone: python -m bench.commands.eval_niah [--needle-set report] [--lengths 1024,2048,4096]
    [--kv-cache-dtype ...]
"""

from __future__ import annotations

import sys
import time

from bench.eval import engine_eval as ee
from bench.eval import needles as nd

NEEDLE = nd.NEEDLES[0]  # --needle-set single's default
INSTRUCTION = "Answer the question using the text above. Question: "


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def add_arguments(p) -> None:
    ee.add_common_arguments(p)
    p.add_argument("--needle-set", choices=nd.NEEDLE_SETS, default="all",
                   help="all (default), choose (the half defaults are chosen on), report (the other half), or single "
                        "(--needle at every --depths)")
    p.add_argument("--lengths", type=_ints, default=[1024, 2048, 4096],
                   help="prompt lengths in tokens (default 1024,2048,4096)")
    p.add_argument("--depths", type=_floats, default=[0.1, 0.5, 0.9],
                   help="needle depths of --needle-set single (default 0.1,0.5,0.9)")
    p.add_argument("--needle", default=NEEDLE.sentence, help="--needle-set single: the sentence hidden in the haystack")
    p.add_argument("--question", default=NEEDLE.question)
    p.add_argument("--answer", default=NEEDLE.answer,
                   help="key fact; a hit is a case-insensitive substring of the answer")
    p.add_argument("--answer-prefix", default=NEEDLE.answer_prefix, help="start of the assistant turn ('' for none)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="answer tokens generated (default 8)")


def plan(args) -> list[tuple[nd.Needle, int, float]]:
    """The (needle, prompt length, depth) trials the arguments ask for."""
    if args.needle_set == "single":
        one = nd.Needle("custom", args.needle, args.question, args.answer, args.answer_prefix)
        return [(one, length, depth) for length in args.lengths for depth in args.depths]
    return nd.schedule(nd.needle_set(args.needle_set), args.lengths)


class Prompts:
    """Token ids of head (template up to the haystack), haystack and tail (question, template end, answer prefix),
    tokenized separately so request 1 (head + haystack) is an exact token prefix of request 2."""

    def __init__(self, tok, max_length: int):
        self.tok = tok
        self._head, self._tail = ee.prompt_frame(tok)
        self.head = tok(self._head, add_special_tokens=False).input_ids
        from bench.data import essay_text

        self.essays = tok(essay_text(min_chars=8 * max_length), add_special_tokens=False).input_ids

    def tail(self, needle: nd.Needle) -> list[int]:
        text = "\n\n" + INSTRUCTION + needle.question + self._tail + (needle.answer_prefix or "")
        return self.tok(text, add_special_tokens=False).input_ids

    def needle(self, needle: nd.Needle) -> list[int]:
        return self.tok(" " + needle.sentence.strip(), add_special_tokens=False).input_ids

    def haystack(self, length: int, depth: float, needle: nd.Needle) -> tuple[list[int], int]:
        """(head + haystack ids, index of the needle's first token) for a prompt of `length` tokens in all."""
        sentence = self.needle(needle)
        n = length - len(self.head) - len(self.tail(needle)) - len(sentence)
        if n < 64 or n > len(self.essays):
            raise SystemExit(f"sgl-kvq eval niah: length {length} leaves {n} haystack tokens")
        k = nd.sentence_boundary(self.tok, self.essays, int(depth * n))
        ids = self.head + self.essays[:k] + sentence + self.essays[k:n]
        return ids, len(self.head) + k


def trial(llm, prompts: Prompts, flush_tail, needle: nd.Needle, length: int, depth: float, args) -> dict:
    hay, needle_at = prompts.haystack(length, depth, needle)
    r1 = llm.generate(input_ids=hay + flush_tail(), sampling_params={"temperature": 0, "max_new_tokens": 1})
    full = hay + prompts.tail(needle)
    r2 = llm.generate(input_ids=full, sampling_params={"temperature": 0, "max_new_tokens": args.max_new_tokens})
    cached = int(r2["meta_info"]["cached_tokens"])
    if cached == 0:
        raise RuntimeError(f"niah length {length} depth {depth}: request 2 reported no cached tokens")
    answer = r2["text"]
    return {"needle": needle.sentence, "kind": needle.kind, "half": nd.half_of(needle), "length": length,
            "depth": depth, "prompt_tokens": len(full), "needle_token": needle_at,
            "request1_cached_tokens": int(r1["meta_info"]["cached_tokens"]), "cached_tokens": cached,
            "needle_in_cache": needle_at + len(prompts.needle(needle)) <= cached,
            "answer": answer, "hit": needle.answer.lower() in answer.lower()}


def _share(trials: list[dict], key: str) -> dict[str, float]:
    """Hit share of the trials grouped by trials' `key`."""
    groups: dict[str, list[bool]] = {}
    for x in trials:
        groups.setdefault(str(x[key]), []).append(x["hit"])
    return {k: sum(v) / len(v) for k, v in groups.items()}


def run(args) -> int:
    t0 = time.time()
    log = ee.logger(args)
    path = ee.model_path(args.model)
    tok = ee.tokenizer(path)
    prompts = Prompts(tok, max(args.lengths))
    trials_planned = plan(args)

    def evaluate(llm, dt):
        flush_tail = ee.FlushTail(len(tok), not args.no_flush, args.seed)
        t1 = time.time()
        trials = []
        for needle, length, depth in trials_planned:
            trials.append(trial(llm, prompts, flush_tail, needle, length, depth, args))
            x = trials[-1]
            log(f"[{dt}] {needle.kind} length {length} depth {depth}: {'HIT ' if x['hit'] else 'miss'} cached "
                f"{x['cached_tokens']}/{x['prompt_tokens']} answer {x['answer']!r}")
        return {"accuracy": sum(x["hit"] for x in trials) / len(trials), "hits": sum(x["hit"] for x in trials),
                "accuracy_by_length": _share(trials, "length"), "accuracy_by_kind": _share(trials, "kind"),
                "cached_tokens": [x["cached_tokens"] for x in trials], "trials": trials,
                "flush_tail_tokens": flush_tail.n, "eval_s": round(time.time() - t1, 1)}

    rows = ee.per_dtype(args, evaluate, log)
    kinds = sorted({n.kind for n, _, _ in trials_planned})
    table = ee.markdown_table(
        ["kv dtype", "hits", *[f"acc @{n}" for n in args.lengths], *[f"acc {k}" for k in kinds], *ee.POOL_HEADER,
         "wall s"],
        [[r["kv_cache_dtype"], f"{r['hits']}/{len(r['trials'])}",
          *[r["accuracy_by_length"][str(n)] for n in args.lengths], *[r["accuracy_by_kind"][k] for k in kinds],
          *ee.pool_columns(r), r["wall_s"]] for r in rows])
    settings = {"needle_set": args.needle_set, "lengths": args.lengths, "max_new_tokens": args.max_new_tokens}
    if args.needle_set == "single":
        settings.update(depths=args.depths, needle=args.needle, question=args.question, answer=args.answer,
                        answer_prefix=args.answer_prefix)
    result = {"eval": "niah", "model": str(path), "settings": ee.settings(args, **settings), "results": rows,
              "seconds": round(time.time() - t0, 1)}
    ee.finish(args, "niah", result, table, log)
    return 0


def main(argv: list[str] | None = None) -> int:
    from bench.commands._subcommands import standalone_main

    return standalone_main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())
