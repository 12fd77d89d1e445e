"""Prefill wall time of each KVQ_PREFILL mode through sglang.Engine: N cold prompts of L tokens in one batch, the
same N prompts plus 112 new tokens each (a radix hit), and 4 cold prompts one at a time; one Engine per setting, in
the order given, SmolLM2 at max_total_tokens 65,536. It isolates the prefill's own cost from the scheduling a
serving load adds (sgl-kvq bench serving measures that).

    python bench/prefill_modes.py kivi4:full,kivi4:paged,auto [--json PATH]   (N, L from the environment)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

NEW = 112


def workloads(ids: list[int], n: int, length: int) -> tuple[list[list[int]], list[list[int]]]:
    """n distinct prompts of `length` tokens from the essays, and each with NEW further tokens."""
    prompts = [ids[i * 1500: i * 1500 + length] for i in range(n)]
    more = [p + ids[30_000 + i * 200: 30_000 + i * 200 + NEW] for i, p in enumerate(prompts)]
    return prompts, more


def measure(setting: str, path, ids: list[int], n: int, length: int) -> dict:
    import sglang as sgl

    from bench.launch import engine_kwargs

    dtype, _, mode = setting.partition(":")
    if mode:
        os.environ["KVQ_PREFILL"] = mode
    else:
        os.environ.pop("KVQ_PREFILL", None)
    prompts, more = workloads(ids, n, length)
    llm = sgl.Engine(**engine_kwargs(path, dtype, max_total_tokens=65536, max_running_requests=16))
    try:
        sp = {"temperature": 0, "max_new_tokens": 1}
        llm.generate(input_ids=ids[40_000:40_300], sampling_params=sp)  # warm-up
        out = {}
        for name, batch in (("cold_s", prompts), ("hit_s", more)):
            t = time.time()
            res = llm.generate(input_ids=batch, sampling_params=sp)
            out[name] = round(time.time() - t, 2)
            out[name.replace("_s", "_cached_tokens")] = sum(r["meta_info"]["cached_tokens"] for r in res)
        llm.flush_cache()
        t = time.time()
        for p in prompts[:4]:
            llm.generate(input_ids=p, sampling_params=sp)
        out["cold_one_by_one_s"] = round(time.time() - t, 2)
        return out
    finally:
        llm.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("settings", help="comma list of dtype[:mode], e.g. kivi4:full,kivi4:paged,auto")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    from transformers import AutoTokenizer

    from bench.data import essay_text
    from bench.models import smollm2

    n, length = int(os.environ.get("N", 4)), int(os.environ.get("L", 1024))
    path = smollm2()
    ids = AutoTokenizer.from_pretrained(path)(essay_text(min_chars=200_000), add_special_tokens=False).input_ids
    result = {"command": "python bench/prefill_modes.py " + args.settings, "prompts": n, "prompt_tokens": length,
              "new_tokens": NEW, "threads": os.environ.get("OMP_NUM_THREADS", "default"), "runs": []}
    for setting in args.settings.split(","):  # a setting may repeat: each is its own run, in order
        result["runs"].append({"setting": setting, **measure(setting, path, ids, n, length)})
        print(result["runs"][-1], flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
