"""Every served dtype's greedy tokens on the tiny fp32 Llama through kvq_torch and kvq_triton (kvq_torch alone for a
format without a Triton kernel, the peers'), written to a JSON or
checked against one: the record that a change meant to leave behaviour alone (the kernels' format interface, a
format registry) gives the same tokens before and after.

    python scripts/greedy_tokens.py write tests/data/greedy_tokens.json     # on the tree before the change
    python scripts/greedy_tokens.py write tests/data/greedy_tokens.json newfmt2    # a new dtype joins the record
    python scripts/greedy_tokens.py check tests/data/greedy_tokens.json     # after it: exit 1 on any difference
    python scripts/greedy_tokens.py check tests/data/greedy_tokens.json kivi2 gear2   # some dtypes only
    python scripts/greedy_tokens.py check tests/data/greedy_tokens.json --backend kvq_triton   # one backend

Each (dtype, backend) runs in a process of its own (2 to 4 minutes each on 2 cores, 18 in all: too slow for CI,
where tests/engine/test_e2e_*.py compare kvq_triton with kvq_torch per dtype). Two turns: the second extends each
conversation, so its extend reads the first turn's prefix from packed pages (a radix hit) and the extend kernel
applies each format's extras, not only decode. fp32 makes greedy tokens exact; SpeCache runs one request at a time
(tests/engine/test_e2e_specache.py: batching makes its top-k picks timing dependent) with a top-k well below the base.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

BACKENDS = ("kvq_torch", "kvq_triton")
WORDS = "def class return import from self lambda yield while for if else try except with as print".split()
SAMPLING = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}
PROMPT_WORDS = (200, 90, 30)  # past the fp16 window (base pages with extras), about one page, inside the window
FOLLOW_WORDS = 20


def prompts() -> list[str]:
    rng = random.Random(25)
    return [" ".join(rng.choice(WORDS) for _ in range(n)) for n in PROMPT_WORDS]


def env_for(dtype: str, backend: str) -> dict[str, str]:
    env = {"TRITON_INTERPRET": "1"} if backend == "kvq_triton" else {}
    if dtype.startswith("specache"):
        env["KVQ_TOPK"] = "8"
    return env


def run_one(dtype: str, backend: str) -> list[list[int]]:
    """-> token ids of both turns' outputs, first turn then second (in this process's engine)."""
    import sglang

    from bench.launch import engine_kwargs
    from bench.models import tiny_llama

    os.environ.update(env_for(dtype, backend))
    llm = sglang.Engine(**engine_kwargs(tiny_llama(), dtype, dtype="float32", mem_fraction_static=0.3,
                                        max_total_tokens=16384, max_running_requests=8, attention_backend=backend))
    one_at_a_time = dtype.startswith("specache")

    def generate(texts):
        if one_at_a_time:
            return [llm.generate(t, SAMPLING) for t in texts]
        return llm.generate(texts, SAMPLING)

    rng = random.Random(26)
    try:
        first = generate(prompts())
        follow = [p + o["text"] + " " + " ".join(rng.choice(WORDS) for _ in range(FOLLOW_WORDS))
                  for p, o in zip(prompts(), first)]
        second = generate(follow)
    finally:
        llm.shutdown()
    return [o["output_ids"] for o in first + second]


def backends_of(dtype: str, backends: tuple[str, ...] = BACKENDS) -> tuple[str, ...]:
    """The backends that serve `dtype`: kvq_triton refuses a format without a Triton kernel (the peers')."""
    from sgl_kvq.config import parse_kv_cache_dtype

    kernel = parse_kv_cache_dtype(dtype).format.kernel is not None
    return tuple(b for b in backends if kernel or b != "kvq_triton")


def record(dtypes: list[str], backends: tuple[str, ...] = BACKENDS) -> dict[str, dict[str, list[list[int]]]]:
    out: dict[str, dict[str, list[list[int]]]] = {}
    for dtype in dtypes:
        for backend in backends_of(dtype, backends):
            res = subprocess.run([sys.executable, __file__, "one", dtype, backend], capture_output=True, text=True)
            if res.returncode:
                sys.stderr.write(res.stderr[-4000:])
                raise SystemExit(f"{dtype} on {backend} failed (exit {res.returncode})")
            out.setdefault(dtype, {})[backend] = json.loads(res.stdout.strip().splitlines()[-1])
            print(f"{dtype} {backend}: {len(out[dtype][backend])} outputs", file=sys.stderr, flush=True)
    return out


def main(argv: list[str]) -> int:
    from sgl_kvq.config import DTYPE_NAMES

    if argv[0] == "one":
        print(json.dumps(run_one(argv[1], argv[2])))
        return 0
    backends = BACKENDS
    if "--backend" in argv:
        i = argv.index("--backend")
        backends, argv = (argv[i + 1],), argv[:i] + argv[i + 2:]
    path, dtypes = Path(argv[1]), argv[2:] or list(DTYPE_NAMES)
    got = record(dtypes, backends)
    if argv[0] == "write":  # into the record's other dtypes, if there is one (a new format adds its own)
        tokens = json.loads(path.read_text())["tokens"] if path.exists() else {}
        for dtype, per_backend in got.items():
            tokens.setdefault(dtype, {}).update(per_backend)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"prompt_words": PROMPT_WORDS, "sampling": SAMPLING, "tokens": tokens}) + "\n")
        return 0
    want = json.loads(path.read_text())["tokens"]
    bad = [f"{d} {b}" for d in dtypes for b in backends_of(d, backends) if got[d][b] != want[d][b]]
    print("same tokens" if not bad else f"different tokens: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
