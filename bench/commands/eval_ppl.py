"""`sgl-kvq eval ppl`: perplexity scored turn by turn through the engine, so later turns read cached quantized KV.

The text's first turns*turn_tokens + 1 tokens are split into turns; request t sends tokens[:end_t + 1] (plus the
overlay-flush tail, bench/eval/engine_eval.py) with logprob_start_len = start_t and max_new_tokens=1, and scores
tokens start_t+1 .. end_t (SGLang reports no logprob for the first position). Its prefix tokens[:start_t] comes from
the radix cache (quantized pages under kvq) and the scored tokens attend to it. A single prefill of the whole text
would never read the pool: extend attention uses the batch's own fresh keys/values and only writes them (quantized)
afterwards, so a plain prefill scores bf16 KV whatever the cache dtype.

Standalone: python -m bench.commands.eval_ppl [--turns 24] [--turn-tokens 192] [--kv-cache-dtype auto,kivi2] ...

The default length (TURNS x TURN_TOKENS, 4,608 tokens scored in 23 cached turns, contexts up to 4.4k) is what the
decision table reads: at 8 turns (1,344 cached-turn tokens, contexts to 1.5k) two runs of the same dtypes on two
machines put kivi4 and peer_int4 in opposite orders (+0.75% / +0.24% against +0.31% / +0.77%), bf16 arithmetic
moving each number by about half a point; at 24 turns kivi4 +0.07%, peer_int4 +0.89%
(bench/results/quality/ppl24-rotation-choose-smollm2.json).
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from bench.eval import engine_eval as ee

TURNS, TURN_TOKENS = 24, 192  # the default run's turns and tokens per turn (3 pages of 64)


def add_arguments(p) -> None:
    ee.add_common_arguments(p)
    p.add_argument("--text", type=Path, help="text file to score (default: the Paul Graham essays)")
    p.add_argument("--held-out", action="store_true",
                   help="score the last three essays, which the default text never reaches (a reporting half)")
    p.add_argument("--turns", type=int, default=TURNS, help=f"number of turns (default {TURNS})")
    p.add_argument("--turn-tokens", type=int, default=TURN_TOKENS,
                   help=f"tokens per turn (default {TURN_TOKENS} = 3 pages of 64)")


def text_ids(tok, path: Path | None, n: int, held_out: bool = False) -> list[int]:
    if path is not None:
        text = path.read_text(encoding="utf-8", errors="replace")
    elif held_out:
        from bench.data import held_out_essay_text

        text = held_out_essay_text()
    else:
        from bench.data import essay_text

        text = essay_text(min_chars=8 * n)
    ids = tok(text, add_special_tokens=False).input_ids[:n]
    if len(ids) < n:
        raise SystemExit(f"sgl-kvq eval ppl: the text has only {len(ids)} tokens, {n} needed")
    return ids


def text_name(args) -> str:
    if args.text:
        return str(args.text)
    return "paul graham essays, held out" if args.held_out else "paul graham essays"


def score_turns(llm, ids: list[int], turn_tokens: int, tail) -> list[dict]:
    """Per turn: the scored tokens' logprobs and the cached prefix length the engine reported."""
    turns = []
    for t in range((len(ids) - 1) // turn_tokens):
        start, end = t * turn_tokens, (t + 1) * turn_tokens
        out = llm.generate(input_ids=ids[:end + 1] + tail(), sampling_params={"temperature": 0, "max_new_tokens": 1},
                           return_logprob=True, logprob_start_len=start)
        meta = out["meta_info"]
        # [(logprob | None, token_id, text)] from position start on; the first is always None. SGLang reports ids
        # >= vocab_size - 1 as 0 (scheduler_components/logprob_result_processor.py clips "padded hash values").
        inp = meta["input_token_logprobs"][:end + 1 - start]
        if len(inp) != end + 1 - start or any(x[1] not in (y, 0) for x, y in zip(inp, ids[start:end + 1])):
            raise RuntimeError(f"turn {t}: input_token_logprobs do not cover tokens {start}..{end}: got "
                               f"{len(inp)} entries, cached {meta['cached_tokens']}")
        lps = [x[0] for x in inp[1:]]  # positions start+1 .. end
        if any(x is None for x in lps):
            raise RuntimeError(f"turn {t}: missing logprobs")
        cached = int(meta["cached_tokens"])
        if t and cached == 0:
            raise RuntimeError(f"turn {t}: the engine reported no cached tokens; the earlier turns were not reused")
        turns.append({"turn": t + 1, "start": start, "end": end, "cached_tokens": cached, "scored": len(lps),
                      "nll_sum": -sum(lps), "ppl": math.exp(-sum(lps) / len(lps))})
    return turns


def ppl_of(turns: list[dict]) -> float:
    return math.exp(sum(t["nll_sum"] for t in turns) / sum(t["scored"] for t in turns))


def run(args) -> int:
    t0 = time.time()
    log = ee.logger(args)
    if args.turns < 2:
        raise SystemExit("sgl-kvq eval ppl: --turns must be >= 2 (turns 2+ are the ones that read cached KV)")
    if args.text and args.held_out:
        raise SystemExit("sgl-kvq eval ppl: --text and --held-out name two texts; pass one")
    path = ee.model_path(args.model)
    tok = ee.tokenizer(path)
    ids = text_ids(tok, args.text, args.turns * args.turn_tokens + 1, args.held_out)

    def evaluate(llm, dt):
        tail = ee.FlushTail(len(tok), not args.no_flush, args.seed)
        t1 = time.time()
        turns = score_turns(llm, ids, args.turn_tokens, tail)
        r = {"ppl_cached_turns": ppl_of(turns[1:]), "ppl_all": ppl_of(turns), "ppl_turn1": turns[0]["ppl"],
             "cached_tokens": [t["cached_tokens"] for t in turns], "turns": turns,
             "flush_tail_tokens": tail.n, "eval_s": round(time.time() - t1, 1)}
        log(f"[{dt}] ppl turns 2+ {r['ppl_cached_turns']:.4f}, all {r['ppl_all']:.4f}, "
            f"cached {r['cached_tokens']}")
        return r

    rows = ee.per_dtype(args, evaluate, log)
    base = next((r for r in rows if r["kv_cache_dtype"] == "auto"), None)
    table = ee.markdown_table(
        ["kv dtype", "ppl turns 2+ (cached KV)", "ppl all", "ppl turn 1 (no cache)", "vs bf16 (turns 2+)",
         *ee.POOL_HEADER, "wall s"],
        [[r["kv_cache_dtype"], r["ppl_cached_turns"], r["ppl_all"], r["ppl_turn1"],
          f"{r['ppl_cached_turns'] / base['ppl_cached_turns'] - 1:+.2%}" if base else "-",
          *ee.pool_columns(r), r["wall_s"]] for r in rows])
    result = {"eval": "ppl", "model": str(path), "tokens": len(ids),
              "settings": ee.settings(args, turns=args.turns, turn_tokens=args.turn_tokens,
                                      text=text_name(args)),
              "results": rows, "seconds": round(time.time() - t0, 1)}
    ee.finish(args, "ppl", result, table, log)
    return 0


def main(argv: list[str] | None = None) -> int:
    from bench.commands._subcommands import standalone_main

    return standalone_main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())
