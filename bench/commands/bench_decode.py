"""`sgl-kvq bench decode`: per-step decode time against context length, per KV dtype, through SGLang's server.

One server per KV dtype (bf16 first: the baseline every ratio is taken against, measured in the same run), all with
the same KV budget and --max-running-requests. For each (batch B, context C): B prompts of C random tokens are
prefilled once (into the radix cache), then sent again as B concurrent streaming requests for 1 + N new tokens
(greedy, EOS ignored): they hit the cache, run one extend together (the last page) and then decode as one batch;
ms/step is the median gap between consecutive streamed tokens over all B requests (the best of --reps), so the
extend, whose time on a loaded machine varies by seconds, is not in it. The server's CPU ms per step (its processes'
user + system time, read from /proc) is taken over request 0's decode tokens. Bytes a step reads
(read_bytes_per_step): KV, B x each layer's tokens read x its bytes per token (the packed base for kvq dtypes, each
layer at its own width; bf16: 2 x KV heads x head_dim x 2 B), plus the fp16 window of the kvq dtypes and SpeCache's
top-k 16-bit rows, a sliding layer read over its window alone where the path does so (reads_window_only); and the
weights once. Their ratio to bf16's is the speed-up the bytes predict, reported beside the measured one.

--tree DTYPE=DIR also runs DTYPE with the sgl_kvq package of checkout DIR (e.g. the commit before a change),
labelled DTYPE@DIR: a before/after comparison in one run against the same bf16 baseline.

Default grid (SmolLM2 allows 8192 positions, so its longest context is 8192 - N - 8): B=1 at 1k, 2k, 4k and the
longest, B=8 at 1k and 2k. Cost is dominated by prefill (kvq extends run the per-request reference) and by the
slowest dtype: on the shared 2-core machine under load (load average 8-10) one server took 4-5 minutes for B=8 and
B=1 at 1k with N=8, so the default grid needs well over the 10-15 minutes budgeted; pass --quick, or --context/
--batch/--skip, there.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from bench.commands.machine import describe

DEFAULT_DTYPES = "auto,kivi4,kivi2,specache2"


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2", help="smollm2 | gemma3 | tiny | a model folder")
    p.add_argument("--kv-cache-dtype", default=DEFAULT_DTYPES, help="comma list; auto = the model's bf16 (first)")
    p.add_argument("--context", default="1024,2048,4096,max",
                   help="comma list of context lengths in tokens; max = the model's limit less the new tokens")
    p.add_argument("--context-length", type=int,
                   help="serve this many positions (SGLang's --context-length; past the model's own limit with "
                        "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1: rotary positions the model was not trained on, "
                        "so the tokens mean nothing, the step's cost is what is measured); max = this less N + 8")
    p.add_argument("--batch", default="1,8", help="comma list of batch sizes")
    p.add_argument("--skip", default="8x4096,8xmax",
                   help="BxC points of the grid left out "
                        "(B=8 at 4k and 8k: prefill alone takes many minutes on 2 cores)")
    p.add_argument("--steps", type=int, default=16, help="decode steps N timed per point")
    p.add_argument("--reps", type=int, default=2, help="timed repetitions per point; the fastest counts")
    p.add_argument("--quick", action="store_true", help="contexts 1024,4096, batches 1,8, N=8, one repetition")
    p.add_argument("--tree", action="append", default=[], metavar="DTYPE=DIR",
                   help="also run DTYPE with the sgl_kvq of checkout DIR (labelled DTYPE@DIR)")
    p.add_argument("--shared-context", action="store_true",
                   help="the B requests share all but their last token: one prefill per point instead of B (long "
                        "contexts on a CPU); each step still reads every request's whole context, but from the same "
                        "pages, which a CPU's cache may then hold")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PATH", help="PNG: ms/step and tok/s ratio to bf16 vs context length")


def grid(args, limit: int) -> list[tuple[int, int]]:
    if args.quick:
        args.context, args.batch, args.steps, args.reps, args.skip = "1024,4096", "1,8", 8, 1, "8x4096"
    top = limit - args.steps - 8
    ctxs = [top if c == "max" else min(int(c), top) for c in args.context.split(",") if c]
    skip = {s.replace("max", str(top)) for s in args.skip.split(",") if s}
    points = [(b, c) for b in map(int, args.batch.split(",")) for c in ctxs if f"{b}x{c}" not in skip]
    if not points:
        raise SystemExit(f"sgl-kvq bench decode: --batch {args.batch} x --context {args.context} leaves no point "
                         f"after --skip {args.skip}; pass --skip '' (or other points) to run them")
    return points


def model_geometry(model: Path) -> dict:
    """The shapes a decode step's bytes follow: layers, KV heads, head_dim, which layers slide (Gemma 3: 15 of 18
    over 512 tokens) and the weights' bytes (every safetensors tensor, the tied embedding once: the lm_head reads all
    of it each step)."""
    cfg = json.loads((model / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types") or ["full_attention"] * layers
    return {"layers": layers, "kv_heads": cfg.get("num_key_value_heads", heads),
            "head_dim": cfg.get("head_dim", cfg["hidden_size"] // heads),
            "max_positions": cfg.get("max_position_embeddings", 8192), "vocab": cfg["vocab_size"],
            "sliding": [t == "sliding_attention" for t in types], "window": cfg.get("sliding_window") or 0,
            "weight_bytes": weight_bytes(model)}


def weight_bytes(model: Path) -> int:
    """Bytes of every tensor in the model's safetensors files, read from their headers."""
    total = 0
    for f in sorted(model.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    return total


def reads_window_only(dtype: str) -> bool:
    """Whether the dtype's decode path on the CPU engine reads a sliding layer's window alone (docs/how-it-works.md,
    Sliding-window layers): the C kernel's (plain KIVI pages read by the pool strategy, not SpeCache's lanes,
    KVQ_CPU_KERNEL on) starts each request's page loop at the first page its window touches; SGLang's torch_native
    (bf16) and kvq_torch's torch paths read the whole context and mask it."""
    from sgl_kvq.config import is_kvq_dtype, parse_kv_cache_dtype

    name = dtype.split(":")[0]
    if not is_kvq_dtype(name):
        return False
    cfg = parse_kv_cache_dtype(name)
    return cfg.format.codec.plain_pages and cfg.format.strategy == "pool" and bool(cfg.cpu_kernel)


def read_bytes_per_step(stats: dict, geo: dict, batch: int, context: int, window_only: bool = False,
                        weight_factor: float = 1.0) -> dict:
    """Bytes one decode step reads: each request's context in the pool's format, layer by layer (a sliding layer
    read over its window alone where the path does so: reads_window_only; the packed base for kvq dtypes, bf16:
    2 x KV heads x head_dim x 2 B a layer; plus the fp16 window of the kvq dtypes and SpeCache's top-k 16-bit rows),
    and the weights once per step (weight_factor 2: the CPU engine reads fp32 copies, patches/cpu_gemm.py)."""
    layers = geo["layers"]
    fp16_layer = 2 * geo["kv_heads"] * geo["head_dim"] * 2
    sliding = geo.get("sliding") or [False] * layers
    page = (stats.get("config") or {}).get("group_size", 1)

    def tokens_read(layer: int) -> int:
        if not (window_only and sliding[layer] and geo.get("window")):
            return context
        first_page = max(context - 1 - geo["window"], 0) // page  # the kernels' first page (attention_ref's window)
        return context - first_page * page

    if "base_bytes_per_token" not in stats:
        kv = sum(tokens_read(li) * fp16_layer for li in range(layers))
    else:
        cfg = stats["config"]
        per_layer = stats.get("layer_base_bytes_per_token") or [stats["base_bytes_per_token"] / layers] * layers
        fp16_tokens = min(context, cfg["residual"] + (context - 1) % cfg["group_size"] + 1)  # open page + R recent
        kv = sum((tokens_read(li) - fp16_tokens) * per_layer[li] + fp16_tokens * fp16_layer for li in range(layers))
        if "specache" in stats:  # top-k rows per (layer, KV head) in 16 bits, read from the host tier
            kv += stats["specache"].get("top_k", 0) * fp16_layer * layers
    return {"kv": int(batch * kv), "weights": int(geo.get("weight_bytes", 0) * weight_factor)}


def step_bytes(stats: dict, geo: dict, batch: int, context: int, window_only: bool) -> dict:
    """A row's read bytes: KV (kv_read_bytes_per_step), weights, and their sum."""
    from sgl_kvq import env

    fp32_weights = batch >= 2 and env.cpu_gemm_mode() == "fp32"  # one row keeps the bf16 GEMV (patches/cpu_gemm.py)
    read = read_bytes_per_step(stats, geo, batch, context, window_only, 2.0 if fp32_weights else 1.0)
    return {"kv_read_bytes_per_step": read["kv"], "weight_read_bytes_per_step": read["weights"],
            "read_bytes_per_step": read["kv"] + read["weights"]}


def server_cpu_seconds(server) -> float:
    """CPU seconds (user + system) the server's processes have used so far: every process of its session
    (launch_server, scheduler, detokenizer), with their reaped children's (each counted once: a reaped child's
    time moves to its parent, in the same session); 0.0 where /proc cannot be read."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == server.proc.pid:  # the session id (field 6): ServerProcess starts a new session
            total += sum(int(f) for f in fields[11:15]) / tick  # utime stime cutime cstime
    return total


def step_seconds(arrivals: list[list[tuple[float, int]]]) -> float:
    """One decode step of the batch: the median time per token between consecutive streamed chunks of each request
    (arrivals: per request (arrival time in seconds, tokens generated so far) per chunk). A chunk may carry more
    than one token when the server's output path falls behind the decode; its gap counts once per token. The first
    chunk of a request comes from its extend and opens its first gap."""
    per_token = []
    for chunks in arrivals:
        for (t0, n0), (t1, n1) in zip(chunks, chunks[1:]):
            if n1 > n0:
                per_token += [(t1 - t0) / (n1 - n0)] * (n1 - n0)
    return statistics.median(per_token) if per_token else float("nan")


def stream_batch(server, ids: list[list[int]], new_tokens: int) -> tuple[list[list[float]], float]:
    """Each prompt of `ids` as its own streaming /generate request, all at once -> per request (arrival time,
    tokens so far) of its streamed chunks, and the server's CPU seconds per token over request 0's decode
    tokens."""
    arrivals: list[list[tuple[float, int]]] = [[] for _ in ids]
    cpu: list[float] = []

    def one(b: int) -> None:
        body = json.dumps({"input_ids": ids[b], "stream": True, "sampling_params": {
            "max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0.0}}).encode()
        req = urllib.request.Request(server.base + "/generate", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            for line in r:
                if line.startswith(b"data:") and not line.startswith(b"data: [DONE]"):
                    now = time.perf_counter()
                    n = json.loads(line[5:])["meta_info"]["completion_tokens"]
                    arrivals[b].append((now, n))
                    if b == 0 and (len(arrivals[0]) == 1 or n == new_tokens):
                        cpu.append((server_cpu_seconds(server), n))

    threads = [threading.Thread(target=one, args=(b,)) for b in range(len(ids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(not a or a[-1][1] != new_tokens for a in arrivals):
        raise RuntimeError(f"streamed {[a[-1][1] if a else 0 for a in arrivals]} tokens, expected {new_tokens} "
                           "per request")
    (c0, n0), (c1, n1) = cpu[0], cpu[-1]
    return arrivals, (c1 - c0) / (n1 - n0) if n1 > n0 else float("nan")


def time_point(server, batch: int, context: int, steps: int, reps: int, vocab: int,
               shared: bool = False) -> tuple[float, float]:
    """Seconds per decode step of `batch` requests at `context` tokens (prefix cached; see the module doc), and
    the server's CPU seconds per step: on a loaded machine wall time mostly measures the other processes (both
    from the repetition with the fastest wall time). shared: the requests share all but their last token (one
    prefill instead of `batch`; a step still reads each request's whole context, from the same pages)."""
    rng = random.Random(context * 31 + batch)
    if shared:  # one context for all, each request's last token its own
        common = [rng.randrange(100, vocab) for _ in range(context - 1)]
        ids = [common + [rng.randrange(100, vocab)] for _ in range(batch)]
    else:
        ids = [[rng.randrange(100, vocab) for _ in range(context)] for _ in range(batch)]
    server.get("/flush_cache")  # answers in plain text
    greedy_one = {"max_new_tokens": 1, "ignore_eos": True, "temperature": 0.0}
    if shared:
        server.post("/generate", {"input_ids": ids[0], "sampling_params": greedy_one})
    server.post("/generate", {"input_ids": ids, "sampling_params": greedy_one})  # prefill into the cache
    best = (float("inf"), float("inf"))
    for _ in range(reps):
        arrivals, cpu = stream_batch(server, ids, 1 + steps)
        best = min(best, (step_seconds(arrivals), cpu))
    return best


def measure(model: Path, label: str, dtype: str, tree: str | None, points, args, budget_gb: float, geo: dict,
            log_dir: Path) -> list[dict]:
    from bench.launch import ServerProcess, baseline_page_size, run_file

    # A 2-hour watchdog: bf16's torch_native extend computes every request's whole-context attention (its queries
    # padded to the full length), so the re-sent batch's one-page extend at B=8 x 16k tokens is one forward of about
    # 9 minutes, past SGLang's 300 s scheduler watchdog, which kills the server. Not a performance flag.
    server_args = ["--model-path", str(model), "--max-running-requests", str(max(b for b, _ in points)),
                   "--watchdog-timeout", "7200"]
    if args.context_length:
        server_args += ["--context-length", str(args.context_length)]
    server_args += ["--page-size", str(baseline_page_size())] if dtype == "auto" else ["--kv-cache-dtype", dtype]
    env = dict(os.environ)
    os.environ["KVQ_KV_CACHE_GB"] = f"{budget_gb:.3f}"
    if args.context_length and args.context_length > geo["max_positions"]:
        os.environ["SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN"] = "1"
    if tree:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(Path(tree).resolve())] + ([env["PYTHONPATH"]]
                                                                                  if env.get("PYTHONPATH") else []))
    rows = []
    log = run_file(log_dir, label)
    try:
        print(f"[decode] {label}: starting a server (log {log})", flush=True)
        with ServerProcess(server_args, log_path=log) as server:
            stats = server.kv_pool_stats()
            window_only = reads_window_only(dtype) and any(geo["sliding"])
            for batch, context in points:
                sec, cpu = time_point(server, batch, context, args.steps, args.reps, geo["vocab"],
                                      args.shared_context)
                row = {"kv_cache_dtype": label, "batch": batch, "context": context, "ms_per_step": sec * 1e3,
                       "cpu_ms_per_step": cpu * 1e3, "tok_per_s": batch / sec,
                       "sliding_reads": "window" if window_only else "whole context",
                       **step_bytes(stats, geo, batch, context, window_only)}
                rows.append(row)
                print(f"[decode] {label} B={batch} C={context}: {row['ms_per_step']:.0f} ms/step "
                      f"({row['cpu_ms_per_step']:.0f} CPU ms), "
                      f"{row['tok_per_s']:.1f} tok/s", flush=True)
            for r in rows:
                r["pool"] = {k: stats.get(k) for k in ("capacity_tokens", "kv_bytes_per_token", "base_bytes_per_token")}
    finally:
        os.environ.clear()
        os.environ.update(env)
    return rows


def ratios(rows: list[dict]) -> None:
    base = {(r["batch"], r["context"]): r for r in rows if r["kv_cache_dtype"] == "auto"}
    for r in rows:
        b = base.get((r["batch"], r["context"]))
        if b:
            r["x_bf16_tok_per_s"] = r["tok_per_s"] / b["tok_per_s"]
            if r.get("cpu_ms_per_step") and b.get("cpu_ms_per_step"):
                r["x_bf16_cpu_per_step"] = r["cpu_ms_per_step"] / b["cpu_ms_per_step"]
            r["x_bf16_read_bytes"] = r["kv_read_bytes_per_step"] / b["kv_read_bytes_per_step"]
            if r.get("read_bytes_per_step") and b.get("read_bytes_per_step"):
                # the speed-up the bytes a step reads (weights + KV) predict, and the share of it measured
                r["bytes_predicted_x_bf16"] = b["read_bytes_per_step"] / r["read_bytes_per_step"]
                r["x_of_bytes_predicted"] = r["x_bf16_tok_per_s"] / r["bytes_predicted_x_bf16"]


COLUMNS = [  # (header, cell of a row)
    ("kv dtype", lambda r: r["kv_cache_dtype"]),
    ("batch", lambda r: r["batch"]),
    ("context", lambda r: r["context"]),
    ("ms/step", lambda r: f"{r['ms_per_step']:.0f}"),
    ("CPU ms/step", lambda r: f"{r.get('cpu_ms_per_step', float('nan')):.0f}"),
    ("x bf16 CPU", lambda r: f"{r.get('x_bf16_cpu_per_step', float('nan')):.2f}"),
    ("tok/s", lambda r: f"{r['tok_per_s']:.1f}"),
    ("x bf16 tok/s", lambda r: f"{r.get('x_bf16_tok_per_s', float('nan')):.2f}"),
    ("KV MB read/step", lambda r: f"{r['kv_read_bytes_per_step'] / 1e6:.1f}"),
    ("x bf16 bytes", lambda r: f"{r.get('x_bf16_read_bytes', float('nan')):.2f}"),
    ("MB read/step (weights + KV)", lambda r: f"{r.get('read_bytes_per_step', float('nan')) / 1e6:.1f}"),
    ("speed-up bytes predict", lambda r: f"{r.get('bytes_predicted_x_bf16', float('nan')):.2f}"),
    ("measured / predicted", lambda r: f"{r.get('x_of_bytes_predicted', float('nan')):.2f}"),
]


def table(rows: list[dict]) -> str:
    head = "| " + " | ".join(h for h, _ in COLUMNS) + " |"
    rule = "|" + "---|" * len(COLUMNS)
    return "\n".join([head, rule] + ["| " + " | ".join(str(cell(r)) for _, cell in COLUMNS) + " |" for r in rows])


PLOT_METRICS = (  # (row key, y label, title after "batch B: ")
    ("ms_per_step", "decode step (ms)", "decode ms/step"),
    ("x_bf16_tok_per_s", "output tok/s (x bf16's)", "output tok/s / bf16's (same run)"),
)


def plot(rows: list[dict], path: str):
    """Decode ms/step (top) and output tok/s against bf16's in the same run (bottom) against context, one column per
    batch, one line per dtype; writes `path` and returns the Figure (None, and nothing written, where no row has a
    step time)."""
    from bench.plots import finite, pyplot, ticks_at

    plt = pyplot()
    batches = sorted({r["batch"] for r in rows})
    names = list(dict.fromkeys(r["kv_cache_dtype"] for r in rows))
    metrics = [m for m in PLOT_METRICS if finite((r.get(m[0]),) for r in rows)]
    if not metrics:
        return None
    fig, axes = plt.subplots(len(metrics), len(batches), figsize=(6 * len(batches), 4 * len(metrics)), squeeze=False)
    for i, (key, ylabel, title) in enumerate(metrics):
        for j, batch in enumerate(batches):
            ax = axes[i][j]
            contexts = set()
            for label in names:
                pts = finite((r["context"], r.get(key)) for r in rows
                             if r["kv_cache_dtype"] == label and r["batch"] == batch)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label="bf16" if label == "auto" else label)
                    contexts.update(c for c, _ in pts)
            if not ax.get_lines():  # no dtype has this number at this batch
                fig.delaxes(ax)
                continue
            if key == "x_bf16_tok_per_s":
                ax.axhline(0.9, color="gray", lw=0.8, ls="--", label="0.9x bf16")
            ax.set_title(f"batch {batch}: {title}", fontsize=10)
            ax.set_xscale("log", base=2)
            ticks_at(ax, contexts)
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return fig


def equal_budget(model: Path, dtypes: list[str], points, steps: int) -> int:
    """One KV budget (bytes) for every server: bf16 holds the largest batch x context with 30% to spare, and every
    dtype's pool holds those tokens with the largest batch's request slots and its running requests' fp16 frames
    (SpeCache's per-request top-k state on the CPU engine needs more than bf16's tokens alone: capacity.split_budget's
    rule)."""
    from bench.commands.serving_workloads import ModelShape, predicted_pool

    shape = ModelShape.of(model)
    top = max(b for b, _ in points)
    need = max(b * (c + steps + 64) for b, c in points)
    budget = int(1.3 * need * shape.dense_bytes_per_token())

    def fits(dtype: str) -> bool:
        pool = predicted_pool(shape, dtype, budget, top)
        frames = top * pool.get("frame_tokens", 0)
        return pool.get("max_running_requests", 0) >= top and pool.get("capacity_tokens", 0) >= need + frames

    while not all(fits(d) for d in dtypes):
        budget = int(budget * 1.05)
    return budget


def run(args) -> int:
    from bench.commands.bench_multiturn import resolve_model
    from bench.launch import run_file

    model = resolve_model(args.model)
    geo = model_geometry(model)
    points = grid(args, args.context_length or geo["max_positions"])
    runs = [(d, d, None) for d in args.kv_cache_dtype.split(",") if d]
    for spec in args.tree:
        dtype, tree = spec.split("=", 1)
        runs.append((f"{dtype}@{tree}", dtype, tree))
    budget_gb = equal_budget(model, [d for _, d, _ in runs], points, args.steps) / 2**30
    log_dir = Path(tempfile.mkdtemp(prefix="sgl-kvq-decode-"))
    print(f"[decode] {len(runs)} servers x {len(points)} points {points}; KV budget {budget_gb:.2f} GiB; "
          f"logs in {log_dir}", flush=True)
    from bench.commands.bench_capacity import startup_error

    machine = describe()
    rows, refused = [], []
    command = "sgl-kvq " + shlex.join(getattr(args, "_argv", None) or sys.argv[1:])

    def save(done: bool) -> None:
        """The JSON so far, after every server: a run of hours (B=8 at 16k tokens) cut off keeps what it measured."""
        if args.json:
            Path(args.json).write_text(json.dumps({"model": args.model, "command": command, "steps": args.steps,
                                                   "reps": args.reps, "kv_budget_gb": budget_gb,
                                                   "shared_context": args.shared_context,
                                                   "context_length": args.context_length or geo["max_positions"],
                                                   "machine": machine, "complete": done,
                                                   "runs": rows, "refused": refused}, indent=1) + "\n")

    t0 = time.time()
    for label, dtype, tree in runs:
        try:
            rows += measure(model, label, dtype, tree, points, args, budget_gb, geo, log_dir)
        except (RuntimeError, TimeoutError) as e:  # a server that does not start or dies: its reason, then the next
            why = startup_error(run_file(log_dir, label)) or str(e).splitlines()[0]
            refused.append({"kv_cache_dtype": label, "refused": why})
            print(f"[decode] {label}: {why}", flush=True)
        ratios(rows)
        save(done=False)
    print(table(rows))
    print(f"[decode] {time.time() - t0:.0f}s")
    save(done=True)
    if args.plot:
        plot(rows, args.plot)
    return 0
