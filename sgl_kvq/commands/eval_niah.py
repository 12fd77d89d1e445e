"""`sgl-kvq eval niah`: needle-in-a-haystack through the engine, the question reading the haystack from the cache.

For each context length and depth: request 1 sends the chat-templated haystack (Paul Graham's essays with the needle
sentence inserted at a sentence boundary near `depth`) with max_new_tokens=1, so its pages enter the radix cache
(quantized under kvq); request 2 sends haystack + question and must report cached_tokens > 0: the question and the
answer then attend to the haystack from the prefix cache. Request 1 carries the overlay-flush tail
(sgl_kvq/eval/engine_eval.py) so every cached page, the needle's included, is read from the packed base. A trial is
a hit when the key fact appears in the greedy answer (case-insensitive substring).

The default needle is one SmolLM2-135M-Instruct retrieves in bf16; the assistant turn starts with an answer prefix
so a few new tokens suffice (decode is the slow part on CPU).

Standalone: python -m sgl_kvq.commands.eval_niah [--lengths 1024,2048] [--depths 0.1,0.5,0.9] [--kv-cache-dtype ...]
"""

from __future__ import annotations

import sys
import time

from sgl_kvq.eval import engine_eval as ee

NEEDLE = "The magic number that Alice wrote on the blackboard was 4817."
QUESTION = "What was the magic number that Alice wrote on the blackboard?"
ANSWER = "4817"
ANSWER_PREFIX = "The magic number that Alice wrote on the blackboard was"
INSTRUCTION = "Answer the question using the text above. Question: "
_SLOT = "\x00HAYSTACK\x00"


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def add_arguments(p) -> None:
    ee.add_common_arguments(p)
    p.add_argument("--lengths", type=_ints, default=[1024, 2048], help="prompt lengths in tokens (default 1024,2048)")
    p.add_argument("--depths", type=_floats, default=[0.1, 0.5, 0.9], help="needle depths (default 0.1,0.5,0.9)")
    p.add_argument("--needle", default=NEEDLE, help="the sentence hidden in the haystack")
    p.add_argument("--question", default=QUESTION)
    p.add_argument("--answer", default=ANSWER, help="key fact; a hit is a case-insensitive substring of the answer")
    p.add_argument("--answer-prefix", default=ANSWER_PREFIX, help="start of the assistant turn ('' for none)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="answer tokens generated (default 8)")


class Prompts:
    """Token ids of head (template up to the haystack), haystack and tail (question, template end, answer prefix),
    tokenized separately so request 1 (head + haystack) is an exact token prefix of request 2."""

    def __init__(self, tok, args):
        self.tok = tok
        if tok.chat_template:
            text = tok.apply_chat_template([{"role": "user", "content": _SLOT}], tokenize=False,
                                           add_generation_prompt=True)
            head, tail = text.split(_SLOT)
        else:
            head, tail = "", "\nAnswer:"
        tail = "\n\n" + INSTRUCTION + args.question + tail + (args.answer_prefix or "")
        self.head = tok(head, add_special_tokens=False).input_ids
        self.tail = tok(tail, add_special_tokens=False).input_ids
        self.needle = tok(" " + args.needle.strip(), add_special_tokens=False).input_ids
        from sgl_kvq.data import essay_text

        self.essays = tok(essay_text(min_chars=8 * max(args.lengths)), add_special_tokens=False).input_ids

    def haystack(self, length: int, depth: float) -> tuple[list[int], int]:
        """(head + haystack ids, index of the needle's first token) for a prompt of `length` tokens in all."""
        n = length - len(self.head) - len(self.tail) - len(self.needle)
        if n < 64 or n > len(self.essays):
            raise SystemExit(f"sgl-kvq eval niah: length {length} leaves {n} haystack tokens")
        k = int(depth * n)
        back = k
        while back > 0 and k - back < 200 and not self.tok.decode(self.essays[back - 1:back]).rstrip().endswith("."):
            back -= 1
        if back > 0 and k - back < 200:  # a sentence end within 200 tokens before the depth
            k = back
        ids = self.head + self.essays[:k] + self.needle + self.essays[k:n]
        return ids, len(self.head) + k


def trial(llm, prompts: Prompts, tail, length: int, depth: float, args) -> dict:
    hay, needle_at = prompts.haystack(length, depth)
    r1 = llm.generate(input_ids=hay + tail(), sampling_params={"temperature": 0, "max_new_tokens": 1})
    full = hay + prompts.tail
    r2 = llm.generate(input_ids=full, sampling_params={"temperature": 0, "max_new_tokens": args.max_new_tokens})
    cached = int(r2["meta_info"]["cached_tokens"])
    if cached == 0:
        raise RuntimeError(f"niah length {length} depth {depth}: request 2 reported no cached tokens")
    answer = r2["text"]
    return {"length": length, "depth": depth, "prompt_tokens": len(full), "needle_token": needle_at,
            "request1_cached_tokens": int(r1["meta_info"]["cached_tokens"]), "cached_tokens": cached,
            "needle_in_cache": needle_at + len(prompts.needle) <= cached,
            "answer": answer, "hit": args.answer.lower() in answer.lower()}


def run(args) -> int:
    t0 = time.time()
    log = ee.logger(args)
    path = ee.model_path(args.model)
    tok = ee.tokenizer(path)
    prompts = Prompts(tok, args)

    def evaluate(llm, dt):
        tail = ee.FlushTail(len(tok), not args.no_flush, args.seed)
        t1 = time.time()
        trials = []
        for length in args.lengths:
            for depth in args.depths:
                trials.append(trial(llm, prompts, tail, length, depth, args))
                x = trials[-1]
                log(f"[{dt}] length {length} depth {depth}: {'HIT ' if x['hit'] else 'miss'} cached "
                    f"{x['cached_tokens']}/{x['prompt_tokens']} answer {x['answer']!r}")
        by_len = {str(n): sum(x["hit"] for x in trials if x["length"] == n) / len(args.depths) for n in args.lengths}
        return {"accuracy": sum(x["hit"] for x in trials) / len(trials), "accuracy_by_length": by_len,
                "cached_tokens": [x["cached_tokens"] for x in trials], "trials": trials,
                "flush_tail_tokens": tail.n, "eval_s": round(time.time() - t1, 1)}

    rows = ee.per_dtype(args, evaluate, log)
    table = ee.markdown_table(
        ["kv dtype", "accuracy", *[f"acc @{n}" for n in args.lengths], *ee.POOL_HEADER, "wall s"],
        [[r["kv_cache_dtype"], f"{sum(x['hit'] for x in r['trials'])}/{len(r['trials'])}",
          *[r["accuracy_by_length"][str(n)] for n in args.lengths], *ee.pool_columns(r), r["wall_s"]] for r in rows])
    result = {"eval": "niah", "model": str(path),
              "settings": ee.settings(args, lengths=args.lengths, depths=args.depths, needle=args.needle,
                                      question=args.question, answer=args.answer, answer_prefix=args.answer_prefix,
                                      max_new_tokens=args.max_new_tokens),
              "results": rows, "seconds": round(time.time() - t0, 1)}
    ee.finish(args, "niah", result, table, log)
    return 0


def main(argv: list[str] | None = None) -> int:
    from sgl_kvq.commands._subcommands import standalone_main

    return standalone_main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())
