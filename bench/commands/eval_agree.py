"""`sgl-kvq eval agree`: greedy-decode agreement of each KV cache dtype with a bf16 reference run, through the engine.

A bf16 engine runs first as the reference; then one engine per --kv-cache-dtype decodes the same prompts greedily
(ignore_eos, exactly --new-tokens tokens each, all prompts in one batch). `auto` listed among the dtypes is a second,
independent bf16 engine: its agreement must be exactly 1.0 (a determinism self-check of the harness and engine).
Prompts are several pages long (default 320 tokens = 5 pages of 64), so every decode step reads quantized pages, not
only the fp16 overlay (the running request's open page plus R/G window pages). Half are essay passages continued as
plain text, half are ShareGPT first turns in the chat template.

Per prompt: the fraction of positions whose token matches the reference, the common prefix length / N, whether the
whole continuation is identical (the table reports their means over the prompts), and where decoding first left the
reference together with the reference's top-1 minus top-2 logprob there: greedy decoding of a small model flips at
near-ties (bf16 logits are coarse), so a flip at a ~0.1 nat margin is noise and one at several nats is an error.

Standalone: python -m bench.commands.eval_agree [--prompts 4] [--prompt-tokens 320] [--new-tokens 64] ...
"""

from __future__ import annotations

import argparse
import sys
import time

from bench.eval import engine_eval as ee


def add_arguments(p) -> None:
    ee.add_common_arguments(p, flush=False)
    p.add_argument("--prompts", type=int, default=4, help="number of prompts (default 4)")
    p.add_argument("--prompt-tokens", type=int, default=320, help="prompt length in tokens (default 320)")
    p.add_argument("--new-tokens", type=int, default=64, help="greedy tokens decoded per prompt, N (default 64)")
    p.add_argument("--source", choices=("mixed", "essays", "sharegpt"), default="mixed",
                   help="prompt source (default mixed: half essays, half ShareGPT first turns)")


def essay_prompts(tok, n: int, length: int) -> list[dict]:
    from bench.data import essays

    out = []
    for i, text in enumerate(essays()):
        ids = tok(text.strip(), add_special_tokens=False).input_ids
        if len(ids) >= length:
            out.append({"source": f"essay[{i}]", "input_ids": ids[:length]})
            if len(out) == n:
                return out
    raise SystemExit(f"sgl-kvq eval agree: only {len(out)} essays have {length} tokens")


def sharegpt_prompts(tok, n: int, length: int) -> list[dict]:
    """First human turns with enough tokens, cut to fit `length` tokens once wrapped in the chat template."""
    from bench.data import sharegpt

    slot = "\x00MSG\x00"
    if tok.chat_template:
        head, tail = tok.apply_chat_template([{"role": "user", "content": slot}], tokenize=False,
                                             add_generation_prompt=True).split(slot)
    else:
        head, tail = "", "\n"
    head = tok(head, add_special_tokens=False).input_ids
    tail = tok(tail, add_special_tokens=False).input_ids
    body = length - len(head) - len(tail)
    out = []
    for i, rec in enumerate(sharegpt()):
        turns = rec.get("conversations") or []
        if not turns or turns[0].get("from") != "human" or len(turns[0].get("value", "")) < 3 * body:
            continue
        ids = tok(turns[0]["value"], add_special_tokens=False).input_ids
        if len(ids) >= body:
            out.append({"source": f"sharegpt[{i}] {rec.get('id', '')}".strip(), "input_ids": head + ids[:body] + tail})
            if len(out) == n:
                return out
    raise SystemExit(f"sgl-kvq eval agree: only {len(out)} ShareGPT first turns have {body} tokens")


def prompts(tok, args) -> list[dict]:
    if args.source == "essays":
        return essay_prompts(tok, args.prompts, args.prompt_tokens)
    if args.source == "sharegpt":
        return sharegpt_prompts(tok, args.prompts, args.prompt_tokens)
    n_essays = (args.prompts + 1) // 2
    return essay_prompts(tok, n_essays, args.prompt_tokens) + \
        sharegpt_prompts(tok, args.prompts - n_essays, args.prompt_tokens)


def decode(llm, ps: list[dict], n: int, margins: bool = False) -> tuple[list[list[int]], list[list[float]] | None]:
    """Greedy continuations; with margins, also the top-1 minus top-2 logprob at every generated position."""
    outs = llm.generate(input_ids=[p["input_ids"] for p in ps],
                        sampling_params={"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
                        return_logprob=margins, top_logprobs_num=2 if margins else 0)
    ids = [list(o["output_ids"]) for o in outs]
    if any(len(x) != n for x in ids):
        raise RuntimeError(f"expected {n} new tokens per prompt, got {[len(x) for x in ids]}")
    if not margins:
        return ids, None
    tops = [o["meta_info"]["output_top_logprobs"] for o in outs]  # [n][2] of (logprob, token_id, text)
    return ids, [[t[0][0] - t[1][0] for t in top] for top in tops]


def first_divergence(ref: list[int], out: list[int], ref_margins: list[float]) -> dict | None:
    """Where greedy decoding first left the reference, and how close the reference's top-2 were there: a flip at a
    near-tie (margin ~ bf16 logit resolution) is numerical noise, a flip at a wide margin is a real error."""
    k = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), None)
    return None if k is None else {"pos": k, "ref_margin": round(ref_margins[k], 4)}


def agreement(ref: list[int], out: list[int]) -> dict:
    n = len(ref)
    prefix = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), n)
    return {"match": sum(a == b for a, b in zip(ref, out)) / n, "prefix": prefix / n, "identical": ref == out}


def summarize(per_prompt: list[dict]) -> dict:
    k = len(per_prompt)
    return {"match_frac": sum(x["match"] for x in per_prompt) / k,
            "common_prefix_frac": sum(x["prefix"] for x in per_prompt) / k,
            "identical_share": sum(x["identical"] for x in per_prompt) / k}


def run(args) -> int:
    t0 = time.time()
    log = ee.logger(args)
    path = ee.model_path(args.model)
    tok = ee.tokenizer(path)
    ps = prompts(tok, args)
    reference = {}

    def evaluate(llm, dt):
        t1 = time.time()
        ids, margins = decode(llm, ps, args.new_tokens, margins="ids" not in reference)
        r = {"eval_s": round(time.time() - t1, 1), "output_ids": ids}
        if margins is not None:
            r["top2_margins"] = [[round(m, 4) for m in ms] for ms in margins]
        if "ids" in reference:
            per = [agreement(a, b) for a, b in zip(reference["ids"], ids)]
            r.update(summarize(per), per_prompt=per,
                     first_divergence=[first_divergence(a, b, m)
                                       for a, b, m in zip(reference["ids"], ids, reference["margins"])])
            log(f"[{dt}] match {r['match_frac']:.3f}, prefix {r['common_prefix_frac']:.3f}, "
                f"identical {r['identical_share']:.2f}")
        return r

    ref_args = argparse.Namespace(**{**vars(args), "kv_cache_dtypes": ["auto"]})
    ref_row = ee.per_dtype(ref_args, evaluate, log)[0]
    reference["ids"], reference["margins"] = ref_row["output_ids"], ref_row["top2_margins"]
    rows = ee.per_dtype(args, evaluate, log)
    table = ee.markdown_table(
        ["kv dtype", "token match", "common prefix / N", "identical", "bf16 top-2 margin at first divergence",
         *ee.POOL_HEADER, "wall s"],
        [[r["kv_cache_dtype"] + (" (2nd bf16 run)" if r["kv_cache_dtype"] == "auto" else ""), r["match_frac"],
          r["common_prefix_frac"], f"{sum(x['identical'] for x in r['per_prompt'])}/{len(ps)}",
          " ".join("-" if d is None else f"{d['ref_margin']:.3g}@{d['pos']}" for d in r["first_divergence"]),
          *ee.pool_columns(r), r["wall_s"]] for r in rows])
    result = {"eval": "agree", "model": str(path),
              "settings": ee.settings(args, prompts=args.prompts, prompt_tokens=args.prompt_tokens,
                                      new_tokens=args.new_tokens, source=args.source),
              "prompts": [{"source": p["source"], "tokens": len(p["input_ids"]),
                           "head": tok.decode(p["input_ids"][:24])} for p in ps],
              "reference": ref_row, "results": rows, "seconds": round(time.time() - t0, 1)}
    ee.finish(args, "agree", result, table, log)
    bad_self = [r for r in rows if r["kv_cache_dtype"] == "auto" and r["match_frac"] != 1.0]
    if bad_self:
        log("FAILED: a second bf16 engine did not reproduce the bf16 reference exactly")
    return 1 if bad_self else 0


def main(argv: list[str] | None = None) -> int:
    from bench.commands._subcommands import standalone_main

    return standalone_main(__name__, argv)


if __name__ == "__main__":
    sys.exit(main())
