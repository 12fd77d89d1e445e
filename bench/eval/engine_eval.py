"""Shared plumbing for the evaluations that run through `sglang.Engine` (sgl-kvq eval niah | ppl | agree).

Each evaluation runs one Engine per --kv-cache-dtype, one after the other, and records for each: its metrics, the
live pool's byte accounting (engine.get_server_info()["internal_states"][0]["kv_pool"]), startup and wall time.

Overlay flush. A running request keeps the fp16 copy of its last pages (R/G + 1 of them) in overlay frames owned by its
request slot, and the pool's read plan takes a cached prefix's last pages from those frames while they still hold them
(sgl_kvq/metadata/host.py `plan_contexts`). SGLang hands out request slots last-in first-out, so when one client sends
turn t+1 right after turn t, turn t+1 usually lands on turn t's slot and reads the end of its cached prefix in fp16, not
from the quantized pages. To measure the quantized cache itself, the request that fills the cache appends a tail of (R/G
+ 1) * G + 1 fresh random tokens (`FlushTail`): its last pages, the ones left in its frames, are then tail pages that
the next turn never matches, so the next turn reads every cached page from the packed base whatever slot it lands on.
The tail only follows the tokens being cached and scored, so it changes no scored logprob (causal attention). Every
dtype gets the same requests. --no-flush drops the tail (serving as is).
"""

from __future__ import annotations

import contextlib
import json
import random
import shlex
import sys
import time
from pathlib import Path

ALL_DTYPES = ("auto", "kivi4", "kivi2", "kivi1")
POOL_FIELDS = ("pool_class", "capacity_tokens", "kv_bytes", "kv_bytes_per_token", "base_bytes_per_token",
               "overlay_bytes", "page_size", "host_bytes", "host_bytes_per_token")


def add_common_arguments(p, default_dtypes: str = ",".join(ALL_DTYPES), flush: bool = True) -> None:
    p.add_argument("--kv-cache-dtype", action="append", dest="kv_cache_dtypes", metavar="X[,Y...]",
                   help=f"KV cache dtype(s), repeatable or comma list; auto = the model's bf16 (default "
                        f"{default_dtypes}); X:KVQ_NAME=VALUE[:...] runs X with those knobs set for its engine "
                        f"only (e.g. kivi2,kivi2:KVQ_ROTATE=hadamard)")
    p.add_argument("--model", default="smollm2", help="smollm2 | gemma3 | tiny | a model folder (default smollm2)")
    p.add_argument("--dtype", help="model dtype override (default: float32 for tiny, the engine default otherwise)")
    p.add_argument("--max-total-tokens", type=int, default=16384, help="pool capacity in tokens (default 16384)")
    p.add_argument("--max-running-requests", type=int, default=8,
                   help="request slots; sizes kvq's fp16 overlay (default 8: these evaluations run few at once)")
    if flush:
        p.add_argument("--no-flush", action="store_true",
                       help="no overlay-flush tail: cached prefixes may end in fp16 frames (engine_eval.py)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", nargs="?", const="-", help="write the JSON result to PATH (stdout without PATH)")
    p.set_defaults(_default_dtypes=default_dtypes)


def dtypes(args) -> list[str]:
    """The --kv-cache-dtype entries as given (a dtype, or a dtype with knobs: `split_knobs`), validated."""
    from sgl_kvq.config import DTYPE_NAMES, is_kvq_dtype

    raw = args.kv_cache_dtypes or [args._default_dtypes]
    out = [d.strip() for item in raw for d in item.split(",") if d.strip()]
    bad = [d for d in out if (name := split_knobs(d)[0]) != "auto" and not is_kvq_dtype(name)]
    if bad:
        raise SystemExit(f"sgl-kvq eval: unknown --kv-cache-dtype {bad}; use auto or one of {', '.join(DTYPE_NAMES)}")
    return out


def split_knobs(entry: str) -> tuple[str, dict[str, str]]:
    """`kivi2:KVQ_ROTATE=hadamard:KVQ_PREFILL=paged` -> ("kivi2", {"KVQ_ROTATE": "hadamard", ...}): one engine of a
    run with knobs of its own, so variants of a dtype are measured in the same run and JSON."""
    dtype, *items = entry.split(":")
    knobs = {}
    for item in items:
        name, eq, value = item.partition("=")
        if not eq or not name.startswith("KVQ_"):
            raise SystemExit(f"sgl-kvq eval: {entry!r}: knobs after the dtype are KVQ_NAME=VALUE, got {item!r}")
        knobs[name] = value
    return dtype, knobs


@contextlib.contextmanager
def knob_env(knobs: dict[str, str]):
    """The process environment with `knobs` set for the block (SGLang's spawned processes inherit it), restored."""
    import os

    saved = {k: os.environ.get(k) for k in knobs}
    os.environ.update(knobs)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def model_path(name: str) -> Path:
    from bench import models

    if name in models.BUILDERS:
        return models.BUILDERS[name]()
    p = Path(name)
    if not (p / "config.json").exists():
        raise SystemExit(f"sgl-kvq eval: --model {name}: not smollm2, tiny or a model folder with config.json")
    return p


def context_length(path: Path) -> int:
    """The model's positions (config.json's max_position_embeddings, its text config's for a multimodal one): what
    SGLang takes as context_len when --context-length is not given."""
    cfg = json.loads((Path(path) / "config.json").read_text())
    return (cfg.get("max_position_embeddings") or cfg.get("text_config", {}).get("max_position_embeddings")
            or 1 << 30)


def model_dtype(args) -> str | None:
    return args.dtype or ("float32" if args.model == "tiny" else None)


def tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def prompt_frame(tok) -> tuple[str, str]:
    """(the text before, the text after) a user's content in one chat-templated user turn with the assistant's turn
    opened; ("", "\nAnswer:") for a tokenizer without a template (a base model: Gemma 3 270M)."""
    if not tok.chat_template:
        return "", "\nAnswer:"
    slot = "\x00CONTENT\x00"
    text = tok.apply_chat_template([{"role": "user", "content": slot}], tokenize=False, add_generation_prompt=True)
    head, tail = text.split(slot)
    return head, tail


def logger(args):
    return (lambda msg: print(msg, file=sys.stderr, flush=True)) if args.json == "-" else \
        (lambda msg: print(msg, flush=True))


def pool_stats(engine) -> dict:
    stats = engine.get_server_info()["internal_states"][0]["kv_pool"]
    return {k: stats[k] for k in POOL_FIELDS if k in stats}


@contextlib.contextmanager
def engine(path: Path, kv_cache_dtype: str, args):
    """A started sglang.Engine for one dtype; shut down on exit (even on error)."""
    import sglang as sgl

    from bench.launch import engine_kwargs

    over = {"max_total_tokens": args.max_total_tokens, "max_running_requests": args.max_running_requests}
    if model_dtype(args):
        over["dtype"] = model_dtype(args)
    llm = sgl.Engine(**engine_kwargs(path, kv_cache_dtype, **over))
    try:
        yield llm
    finally:
        llm.shutdown()


def per_dtype(args, evaluate, log) -> list[dict]:
    """For each dtype: start an Engine, `evaluate(llm, dtype) -> dict`, record pool bytes and times."""
    path = model_path(args.model)
    rows = []
    for entry in dtypes(args):
        dt, knobs = split_knobs(entry)
        t0 = time.time()
        with knob_env(knobs), engine(path, dt, args) as llm:
            startup = time.time() - t0
            pool = pool_stats(llm)
            log(f"[{entry}] engine up in {startup:.0f}s: {pool.get('kv_bytes_per_token', 0):.0f} B/token "
                f"(base {pool.get('base_bytes_per_token', pool.get('kv_bytes_per_token', 0)):.0f}), "
                f"capacity {pool.get('capacity_tokens')} tokens")
            row = {"kv_cache_dtype": entry, "kv_pool": pool}
            if knobs:
                row.update(dtype=dt, knobs=knobs)
            row.update(evaluate(llm, entry))
            specache = llm.get_server_info()["internal_states"][0]["kv_pool"].get("specache")
            if specache is not None:  # SpeCache's counters over the whole evaluation (recall, bytes moved, ...)
                row["specache"] = specache
        row["startup_s"] = round(startup, 1)
        row["wall_s"] = round(time.time() - t0, 1)
        rows.append(row)
        save_partial(args, rows)
    return rows


def partial_path(args) -> Path | None:
    """Where the rows measured so far are kept while an evaluation runs (removed by finish): a run cut short keeps
    every dtype it finished."""
    return Path(args.json + ".partial") if getattr(args, "json", None) and args.json != "-" else None


def save_partial(args, rows: list[dict]) -> None:
    path = partial_path(args)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"partial": True, "argv": sys.argv[1:], "results": rows}, indent=1) + "\n")


class FlushTail:
    """Fresh random token tails that push a request's fp16 overlay frames past the tokens it caches (module doc)."""

    def __init__(self, vocab_size: int, enabled: bool, seed: int = 0):
        from sgl_kvq.config import parse_kv_cache_dtype

        cfg = parse_kv_cache_dtype("kivi2")  # G and R come from the KVQ_* knobs, the same for every kvq dtype
        self.n = cfg.ring_pages * cfg.group_size + 1 if enabled else 0
        self.rng = random.Random(f"flush-{seed}")
        self.lo, self.hi = min(300, vocab_size // 4), vocab_size - 1  # clear of special tokens

    def __call__(self) -> list[int]:
        return [self.rng.randrange(self.lo, self.hi) for _ in range(self.n)]


def settings(args, **extra) -> dict:
    out = {"model_dtype": model_dtype(args) or "engine default", "max_total_tokens": args.max_total_tokens,
           "max_running_requests": args.max_running_requests, "seed": args.seed}
    if hasattr(args, "no_flush"):
        out["flush_overlay"] = not args.no_flush
    out.update(extra)
    return out


def finish(args, name: str, result: dict, table: str, log) -> None:
    from sgl_kvq import env

    result["command"] = f"sgl-kvq eval {name} " + shlex.join(getattr(args, "_argv", None) or argv_after(name))
    result.update(env.run_record())
    log(table)
    if args.json:
        text = json.dumps(result, indent=1)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(text + "\n")
            partial_path(args).unlink(missing_ok=True)


def argv_after(name: str) -> list[str]:
    argv = sys.argv[1:]
    return argv[argv.index(name) + 1:] if name in argv else argv


def markdown_table(header: list[str], rows: list[list]) -> str:
    def cell(x):
        if isinstance(x, float):
            return f"{x:.0f}" if abs(x) >= 1000 else f"{x:.4g}"
        return str(x)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def pool_columns(row: dict) -> list:
    p = row["kv_pool"]
    sc = row.get("specache")
    recall = "-" if not sc or sc.get("recall") is None else f"{sc['recall']:.3f}"
    return [round(p["kv_bytes_per_token"], 1), round(p.get("base_bytes_per_token", p["kv_bytes_per_token"]), 1),
            round(p.get("host_bytes_per_token", 0), 1), p["capacity_tokens"], recall]


# KV B/token: device bytes (base + fp16 overlay + SpeCache's top-k buffers) / capacity; host B/token: SpeCache's
# 16-bit host tier / capacity; top-k recall: share of the output row's exact top-k the speculative lane prefetched.
POOL_HEADER = ["KV B/token (live pool)", "base B/token", "host B/token", "capacity tokens", "top-k recall"]
