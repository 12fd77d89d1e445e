"""`sgl-kvq eval longdoc`: questions about one long document, every question reading it from the radix cache.

For each length (default 8k, 16k and 32k tokens: the whole prompt, question and answer included, fits the length):
a document of essays read from the last file backwards (bench.data.long_document_text) with every fact of
bench/eval/longdoc.py planted at sentence boundaries at spread depths (each fact at another depth at every length).
Request 1 sends the document with the overlay-flush tail (bench/eval/engine_eval.py) and max_new_tokens=1: one long
prefill per dtype and length, whose pages enter the radix cache (quantized under kvq). Then one request per question
of the chosen half: document + question, greedy; it must be served from the cache (the share of the document's
tokens it reports cached is recorded; a question with none cached is an error). A question is a hit when each of its
answers appears in the answer, in order.

With bf16 (`auto`) in the run, each dtype is also scored against it: of the questions bf16 answers, how many the
dtype answers too, per length.

Standalone: python -m bench.commands.eval_longdoc --model gemma3 [--fact-set report] [--lengths 8192,16384,32768]
"""

from __future__ import annotations

import sys
import time

from bench.eval import engine_eval as ee
from bench.eval import longdoc as ld
from bench.eval.needles import sentence_boundary

DEFAULT_DTYPES = "auto,kivi4,kivi3,kivi2,specache1,specache2,peer_int4,peer_tq3,peer_tq4,peer_fp8_e4m3"
INSTRUCTION = "Answer the question using the text above. Question: "
# SGLang admits at most context_len - 6 prompt tokens (tp_worker.py: max_req_len - 5, max_req_len = context_len - 1):
# a length at the model's whole context builds its prompts that much shorter.
SGLANG_INPUT_MARGIN = 6
POOL_MARGIN = 8192  # tokens beyond the longest prompt, so the previous length's document is evictable, not in the way


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def add_arguments(p) -> None:
    ee.add_common_arguments(p, default_dtypes=DEFAULT_DTYPES)
    p.set_defaults(max_total_tokens=None)
    p.add_argument("--fact-set", choices=ld.FACT_SETS, default="report",
                   help="report (default: the half results are read from), choose (the half defaults are chosen "
                        "on), or all")
    p.add_argument("--lengths", type=_ints, default=[8192, 16384, 32768],
                   help="prompt lengths in tokens (default 8192,16384,32768); each must fit the model's positions")
    p.add_argument("--max-new-tokens", type=int, default=12, help="answer tokens generated (default 12)")


class Documents:
    """Token ids of the head (template up to the document), each length's document, and each question's tail,
    tokenized apart so head + document is an exact token prefix of every question's prompt."""

    def __init__(self, tok, max_length: int):
        self.tok = tok
        self._head, self._tail = ee.prompt_frame(tok)
        self._sep = " " if self._tail.endswith(":") else ""  # a template's assistant turn ends in a newline
        self.head = tok(self._head, add_special_tokens=False).input_ids
        from bench.data import long_document_text

        self.text = tok(long_document_text(6 * max_length), add_special_tokens=False).input_ids
        self.planted = [tok(" " + s, add_special_tokens=False).input_ids for s in ld.sentences()]

    def tail(self, fact: ld.Fact) -> list[int]:
        text = "\n\n" + INSTRUCTION + fact.question + self._tail + self._sep + fact.answer_prefix
        return self.tok(text, add_special_tokens=False).input_ids

    def document(self, length: int, length_index: int, reserve: int) -> tuple[list[int], dict[str, int]]:
        """(head + document ids, planted sentence -> its first token's index) for prompts of at most `length`
        tokens once `reserve` more (the longest question tail and the answer) follow."""
        n = length - len(self.head) - reserve - sum(map(len, self.planted))
        if n < 256 or n > len(self.text):
            raise SystemExit(f"sgl-kvq eval longdoc: length {length} leaves {n} document tokens")
        at = [sentence_boundary(self.tok, self.text, int(d * n)) for d in ld.depths(len(self.planted), length_index)]
        order = sorted(range(len(at)), key=lambda i: at[i])
        sentences, ids, where, prev = ld.sentences(), list(self.head), {}, 0
        for i in order:
            ids += self.text[prev:at[i]]
            where[sentences[i]] = len(ids)
            ids += self.planted[i]
            prev = at[i]
        return ids + self.text[prev:n], where


def _by_bf16(rows: list[dict], lengths: list[int]) -> None:
    """Each row's hits among the questions bf16 answers in the same run, per length (row["vs_bf16"])."""
    base = next((r for r in rows if r["kv_cache_dtype"] == "auto"), None)
    if base is None:
        return
    answered = {(q["length"], q["question"]) for q in base["questions"] if q["hit"]}
    for r in rows:
        r["vs_bf16"] = {str(n): {"bf16_hits": sum(1 for length, _ in answered if length == n),
                                 "also_hit": sum(1 for q in r["questions"] if q["hit"] and q["length"] == n
                                                 and (n, q["question"]) in answered)} for n in lengths}


def run(args) -> int:
    t0 = time.time()
    log = ee.logger(args)
    path = ee.model_path(args.model)
    tok = ee.tokenizer(path)
    facts = ld.fact_set(args.fact_set)
    docs = Documents(tok, max(args.lengths))
    if args.max_total_tokens is None:
        args.max_total_tokens = max(args.lengths) + POOL_MARGIN

    # every dtype reads the same documents: built once
    flush_n = ee.FlushTail(len(tok), not args.no_flush, args.seed).n
    reserve = max(max(len(docs.tail(f)) for f in facts) + args.max_new_tokens, flush_n + 1)
    limit = ee.context_length(path) - SGLANG_INPUT_MARGIN
    documents = [docs.document(min(length, limit), j, reserve) for j, length in enumerate(args.lengths)]
    tails = {fact: docs.tail(fact) for fact in facts}

    def evaluate(llm, dt):
        flush_tail = ee.FlushTail(len(tok), not args.no_flush, args.seed)
        questions, prefills = [], []
        for length, (doc, where) in zip(args.lengths, documents):
            t1 = time.time()
            r1 = llm.generate(input_ids=doc + flush_tail(), sampling_params={"temperature": 0, "max_new_tokens": 1})
            prefills.append({"length": length, "document_tokens": len(doc), "prefill_s": round(time.time() - t1, 1),
                             "cached_tokens": int(r1["meta_info"]["cached_tokens"])})
            log(f"[{dt}] length {length}: document of {len(doc)} tokens prefilled in {prefills[-1]['prefill_s']} s")
            for fact in facts:
                t1 = time.time()
                r = llm.generate(input_ids=doc + tails[fact],
                                 sampling_params={"temperature": 0, "max_new_tokens": args.max_new_tokens})
                cached = int(r["meta_info"]["cached_tokens"])
                if cached == 0:
                    raise RuntimeError(f"longdoc length {length}: the question {fact.question!r} reported no cached "
                                       "tokens; the radix cache did not serve the document")
                answer = r["text"]
                questions.append({"kind": fact.kind, "half": ld.half_of(fact), "question": fact.question,
                                  "length": length, "depths": [round(where[s] / len(doc), 3) for s in fact.sentences],
                                  "cached_tokens": cached, "cached_share": round(min(cached, len(doc)) / len(doc), 4),
                                  "answer": answer, "hit": ld.hit(fact, answer), "seconds": round(time.time() - t1, 1)})
                q = questions[-1]
                log(f"[{dt}] {fact.kind} length {length}: {'HIT ' if q['hit'] else 'miss'} cached {cached}/{len(doc)} "
                    f"answer {answer!r}")
        hits = {str(n): sum(q["hit"] for q in questions if q["length"] == n) for n in args.lengths}
        return {"hits": sum(hits.values()), "questions_asked": len(questions), "hits_by_length": hits,
                "min_cached_share": min(q["cached_share"] for q in questions), "prefills": prefills,
                "questions": questions, "flush_tail_tokens": flush_tail.n}

    rows = ee.per_dtype(args, evaluate, log)
    _by_bf16(rows, args.lengths)
    per = len(facts)

    def vs(r, n):
        v = r.get("vs_bf16", {}).get(str(n))
        return f"{v['also_hit']}/{v['bf16_hits']}" if v else "-"

    table = ee.markdown_table(
        ["kv dtype", *[f"hits @{n}" for n in args.lengths], *[f"of bf16's @{n}" for n in args.lengths],
         "min cached share", *[f"prefill s @{n}" for n in args.lengths], *ee.POOL_HEADER, "wall s"],
        [[r["kv_cache_dtype"], *[f"{r['hits_by_length'][str(n)]}/{per}" for n in args.lengths],
          *[vs(r, n) for n in args.lengths], r["min_cached_share"], *[p["prefill_s"] for p in r["prefills"]],
          *ee.pool_columns(r), r["wall_s"]] for r in rows])
    settings = {"fact_set": args.fact_set, "facts_planted": len(ld.FACTS), "lengths": args.lengths,
                "max_new_tokens": args.max_new_tokens}
    result = {"eval": "longdoc", "model": str(path), "settings": ee.settings(args, **settings), "results": rows,
              "seconds": round(time.time() - t0, 1)}
    ee.finish(args, "longdoc", result, table, log)
    return 0


def main(argv: list[str] | None = None) -> int:
    from bench.commands._subcommands import standalone_main

    return standalone_main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())
