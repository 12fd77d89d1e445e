"""The CPU work of one decode step outside the model, kvq_torch against bf16's torch_native, and what OpenMP's second
thread does to kvq_torch's batched decode attention (README "Where a decode step's time goes").

    python bench/decode_work.py                  # SmolLM2's geometry (30 layers, 3 KV heads, 9 query heads, D=64)
    python bench/decode_work.py --batch 8 --context 2048

work: per decode step of B requests at C tokens, thread CPU time on ONE thread (time.thread_time: what the step
costs, whatever else the machine runs): kivi2's plan build (build_forward_plan), prepare, per-layer writes and
batched attention over a QuantizedKVStore the extend path filled; bf16's per-layer KV write (index_put into a [S, H, D]
bf16 cache) and torch_native's per-request gather + SDPA (sglang's _run_sdpa_forward_decode, the same ops).
threads: one layer of kvq_torch's batched decode, 2 intra-op threads and 1 alternately in one process, wall time
(median and mean of 30): on a loaded machine the 2-thread joins wait for descheduled threads.

    python bench/decode_work.py --paths --batch 1 8 16 --context 512 --ragged

paths: one layer of kvq_torch's two decode paths alternately in one process, thread CPU time on one thread (median
of 40): the padded dequantized layout (attention_batched) and page by page with the scales folded
(attention_pages), on the same batch; --ragged gives each request a context drawn from 20..C (a ShareGPT-like
batch), else all C.

    python bench/decode_work.py --kernel --batch 1 4 8 --context 256

kernel: one layer of each kvq_torch decode (the padded layout, page by page, and the C kernel
kernels/cpu_decode_attention.c) and of bf16 torch_native's gather + SDPA over the same contexts, alternately in one
process with torch's own thread count, wall time (median of 40): what a decode step pays per layer. kvq_rotate is
what KVQ_ROTATE=hadamard adds to it (sgl_kvq/attention_rotation.py: q, k, v rotated and the output rotated back).

    python bench/decode_work.py --widths 3x3 3x2 4x2 --geometry gemma3 --batch 16 --against 0bf5418

widths: one layer of the C kernel per (key bits)x(value bits) pair (a recipe's layers), thread CPU time on one
thread (median of 40); --against REV: the kernel of that git revision too, alternately, on the same pages.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from sgl_kvq import attention_batched as ab
from sgl_kvq import attention_pages as ap
from sgl_kvq.attention_rotation import HeadRotation
from sgl_kvq.config import KVQConfig
from sgl_kvq.kv_store import QuantizedKVStore
from sgl_kvq.metadata.forward import build_forward_plan
from sgl_kvq.pool_shape import PoolShape
from sgl_kvq.quant.rotation import hadamard

L, H, HQ, D, G = 30, 3, 9, 64, 64


def filled_store(B: int, C: int, bits: int, cfg: KVQConfig | None = None, geometry: tuple[int, int, int] = (L, H, D)):
    """A kivi store (cfg: another config) of `geometry` (layers, KV heads, head_dim) holding B requests of C tokens
    -> (store, req_to_token, request rows)."""
    layers, heads, dim = geometry
    cfg = cfg or KVQConfig("kivi", bits, group_size=G, value_group=64, residual=64)
    pages_per = -(-(C + 64) // G) + 1
    store = QuantizedKVStore(cfg, PoolShape(layers, heads, dim, B * pages_per + 2, cfg), B + 1, torch.bfloat16,
                             "cpu")
    req_to_token = torch.zeros(B + 1, pages_per * G, dtype=torch.int32)
    for b in range(B):
        pages = torch.arange(1 + b * pages_per, 1 + (b + 1) * pages_per)
        pos = torch.arange(pages_per * G)
        req_to_token[b + 1] = (pages[pos // G] * G + pos % G).int()
    reqs = torch.arange(1, B + 1)
    loc = req_to_token[1:, :C].reshape(-1).long()
    fp = build_forward_plan(store, req_to_token, reqs, torch.full((B,), C), loc, is_decode=False,
                            extend_prefix_lens=[0] * B, extend_seq_lens=[C] * B)
    k = torch.randn(B * C, heads, dim, dtype=torch.bfloat16)
    for li in range(layers):
        for st in fp.steps:
            store.write_layer(li, st.write, k, k)
    return store, req_to_token, reqs


def kvq_work(B: int, C: int, bits: int, steps: int) -> dict:
    store, req_to_token, reqs = filled_store(B, C, bits)
    tm = dict.fromkeys(("plan", "prepare", "write", "attention"), 0.0)
    n = C
    for _ in range(steps):
        n += 1
        t = time.thread_time()
        fp = build_forward_plan(store, req_to_token, reqs, torch.full((B,), n), req_to_token[1:, n - 1].long(),
                                is_decode=True)
        tm["plan"] += time.thread_time() - t
        st = fp.steps[0]
        t = time.thread_time()
        ctx = ab.prepare(st.plan, G, H)
        tm["prepare"] += time.thread_time() - t
        kn, q = torch.randn(B, H, D, dtype=torch.bfloat16), torch.randn(B, HQ, D, dtype=torch.bfloat16)
        for li in range(L):
            t = time.thread_time()
            store.write_layer(li, st.write, kn, kn)
            tm["write"] += time.thread_time() - t
            t = time.thread_time()
            ab.decode(q, store.layer_view(li), ctx, D ** -0.5)
            tm["attention"] += time.thread_time() - t
    return {k: v / steps * 1e3 for k, v in tm.items()}


def bf16_work(B: int, C: int, steps: int) -> dict:
    kc = torch.zeros(L, B * (C + steps) + 1, H, D, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    tokens = torch.arange(1, B * (C + steps) + 1).view(B, C + steps)
    tw = ta = 0.0
    for s in range(steps):
        n = C + s + 1
        loc = tokens[:, n - 1]
        kn, q = torch.randn(B, H, D, dtype=torch.bfloat16), torch.randn(HQ, B, D, dtype=torch.bfloat16)
        for li in range(L):
            t = time.thread_time()
            kc[li][loc] = kn
            vc[li][loc] = kn
            tw += time.thread_time() - t
            t = time.thread_time()
            for b in range(B):
                k, v = kc[li][tokens[b, :n]].movedim(0, 1), vc[li][tokens[b, :n]].movedim(0, 1)
                torch.nn.functional.scaled_dot_product_attention(q[:, b:b + 1].unsqueeze(0), k.unsqueeze(0),
                                                                 v.unsqueeze(0), enable_gqa=True, scale=D ** -0.5)
            ta += time.thread_time() - t
    return {"write": tw / steps * 1e3, "attention": ta / steps * 1e3}


def threads(B: int, C: int, bits: int, reps: int = 30) -> dict:
    store, req_to_token, reqs = filled_store(B, C, bits)
    fp = build_forward_plan(store, req_to_token, reqs, torch.full((B,), C + 1), req_to_token[1:, C].long(),
                            is_decode=True)
    ctx = ab.prepare(fp.steps[0].plan, G, H)
    q, kv = torch.randn(B, HQ, D, dtype=torch.bfloat16), store.layer_view(0)
    prev = torch.get_num_threads()
    times: dict[int, list[float]] = {2: [], 1: []}
    for _ in range(reps):
        for n in (2, 1):
            torch.set_num_threads(n)
            t = time.perf_counter()
            ab.decode(q, kv, ctx, D ** -0.5)
            times[n].append(time.perf_counter() - t)
    torch.set_num_threads(prev)
    return {f"{n}_threads_ms": {"median": statistics.median(v) * 1e3, "mean": statistics.fmean(v) * 1e3}
            for n, v in times.items()}


def decode_batch(B: int, C: int, bits: int, ragged: bool):
    """One decode step's batch over a filled kivi store: contexts all C tokens, or drawn from 20..C when ragged.
    -> (its plan, context lengths, queries, layer 0's view)."""
    store, req_to_token, reqs = filled_store(B, C, bits)
    gen = torch.Generator().manual_seed(B * C)
    lens = torch.randint(20, C + 1, (B,), generator=gen) if ragged else torch.full((B,), C)
    fp = build_forward_plan(store, req_to_token, reqs, lens + 1, req_to_token[reqs, lens].long(), is_decode=True)
    return fp.steps[0].plan, lens, torch.randn(B, HQ, D, dtype=torch.bfloat16), store.layer_view(0)


def median_ms(runs: dict, reps: int, clock) -> dict:
    """Each run called reps times, alternately with the others -> "<name>_ms": its median time by `clock`."""
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(reps):
        for name, run in runs.items():
            t = clock()
            run()
            times[name].append(clock() - t)
    return {f"{k}_ms": statistics.median(v) * 1e3 for k, v in times.items()}


def paths(B: int, C: int, bits: int, ragged: bool, reps: int = 40) -> dict:
    plan, lens, q, kv = decode_batch(B, C, bits, ragged)
    ctx, idx, ws = ab.prepare(plan, G, H), ap.index(plan, G, H), ab.Workspace()
    runs = {"padded": lambda: ab.decode(q, kv, ctx, D ** -0.5, ws),
            "pages": lambda: ap.decode(q, kv, idx, D ** -0.5, ws)}
    torch.testing.assert_close(runs["pages"]().float(), runs["padded"]().float(), rtol=2e-2, atol=2e-2)
    out = median_ms(runs, reps, time.thread_time)
    return {"batch": B, "context": C, "ragged": ragged, "tokens": int(lens.sum()), "kvq_bits": bits, **out,
            "padded_over_pages": out["padded_ms"] / out["pages_ms"]}


def kernel(B: int, C: int, bits: int, ragged: bool, reps: int = 40) -> dict:
    from sgl_kvq.kernels import cpu_decode_attention as cda

    plan, lens, q, kv = decode_batch(B, C, bits, ragged)
    ctx, idx, ws = ab.prepare(plan, G, H), ap.index(plan, G, H), ab.Workspace()
    kc = torch.randn(int(lens.sum()) + B, H, D, dtype=torch.bfloat16)
    tokens = [torch.arange(int(s), int(e)) for s, e in zip([0, *(lens + 1).cumsum(0)[:-1]], (lens + 1).cumsum(0))]

    def bf16():  # sglang's torch_native decode: per request a gather of its K and V rows and one SDPA
        for b in range(B):
            k = kc[tokens[b]].movedim(0, 1)
            torch.nn.functional.scaled_dot_product_attention(q[b:b + 1].transpose(0, 1).unsqueeze(0), k.unsqueeze(0),
                                                             kc[tokens[b]].movedim(0, 1).unsqueeze(0),
                                                             enable_gqa=True, scale=D ** -0.5)

    rot, kv_new = HeadRotation(hadamard(D)), torch.randn(B, H, D, dtype=torch.bfloat16)
    runs = {"padded": lambda: ab.decode(q, kv, ctx, D ** -0.5, ws),
            "pages": lambda: ap.decode(q, kv, idx, D ** -0.5, ws),
            "cpu_kernel": lambda: cda.decode_attention(q, kv, plan, D ** -0.5, check=False),
            "bf16_torch_native": bf16,
            "kvq_rotate": lambda: (rot.into(q), rot.into(kv_new), rot.into(kv_new), rot.back(q))}
    torch.testing.assert_close(runs["cpu_kernel"]().float(), runs["padded"]().float(), rtol=2e-2, atol=2e-2)
    return {"batch": B, "context": C, "ragged": ragged, "tokens": int(lens.sum()), "kvq_bits": bits,
            "threads": torch.get_num_threads(), **median_ms(runs, reps, time.perf_counter)}


GEOMETRIES = {"gemma3": (1, 4, 256), "smollm2": (H, HQ, D)}  # (KV heads, query heads, head_dim)


def kernel_at(rev: str):
    """The C kernel's library built from its source at git revision `rev` (a temporary file)."""
    import ctypes
    import subprocess
    import tempfile

    from sgl_kvq.kernels import cpu_decode_attention as cda

    src = subprocess.run(["git", "show", f"{rev}:kernels/cpu_decode_attention.c"], capture_output=True, text=True,
                         check=True).stdout
    d = tempfile.mkdtemp()
    with open(f"{d}/k.c", "w") as f:
        f.write(src)
    subprocess.run([cda.compiler(), *cda.FLAGS, f"{d}/k.c", "-o", f"{d}/k.so", "-lm"], check=True)
    lib = ctypes.CDLL(f"{d}/k.so")
    cda.available()
    lib.kvq_cpu_decode.restype = cda._lib.kvq_cpu_decode.restype
    lib.kvq_cpu_decode.argtypes = cda._lib.kvq_cpu_decode.argtypes
    return lib


def widths(B: int, C: int, pairs: list[tuple[int, int]], geometry: str, against: str | None = None,
           reps: int = 40) -> dict:
    """One layer of the C kernel per (key bits, value bits) pair, the pairs as the layers of one kivimix pool,
    alternately in one process, thread CPU time on one thread (median): a recipe's layer must cost what its widths
    cost. against: also the kernel of that git revision, alternately with this tree's, on the same pages."""
    from sgl_kvq.formats.kivi import RecipeParams
    from sgl_kvq.kernels import cpu_decode_attention as cda
    from sgl_kvq.recipe import ModelBinding, Recipe

    heads, q_heads, dim = GEOMETRIES[geometry]
    recipe = Recipe(ModelBinding(len(pairs), heads, dim, "0" * 16), tuple(k for k, _ in pairs),
                    tuple(v for _, v in pairs))
    cfg = KVQConfig("kivimix", 4, group_size=G, value_group=64, residual=64, params=RecipeParams(recipe))
    store, req_to_token, reqs = filled_store(B, C, 4, cfg, (len(pairs), heads, dim))
    plan = build_forward_plan(store, req_to_token, reqs, torch.full((B,), C + 1), req_to_token[1:, C].long(),
                              is_decode=True).steps[0].plan
    q = torch.randn(B, q_heads, dim, dtype=torch.bfloat16)
    torch.set_num_threads(1)
    cda.available()
    libs = {"": cda._lib, **({f"@{against}": kernel_at(against)} if against else {})}

    def run(li, lib):
        cda._lib = lib
        return cda.decode_attention(q, store.layer_view(li), plan, dim ** -0.5, check=False)

    runs = {f"K{k}V{v}{tag}": (lambda li=li, lib=lib: run(li, lib))
            for li, (k, v) in enumerate(pairs) for tag, lib in libs.items()}
    try:
        if against:
            for li in range(len(pairs)):
                torch.testing.assert_close(run(li, libs[f"@{against}"]), run(li, libs[""]), rtol=1e-2, atol=1e-2)
        out = median_ms(runs, reps, time.thread_time)
    finally:
        cda._lib = libs[""]
    return {"batch": B, "context": C, "geometry": geometry, "kv_heads": heads, "q_heads": q_heads, "head_dim": dim,
            **out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--bits", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--paths", action="store_true", help="compare the two decode paths instead (see above)")
    p.add_argument("--kernel", action="store_true", help="the C kernel against both torch paths and bf16 (above)")
    p.add_argument("--ragged", action="store_true", help="--paths, --kernel: contexts drawn from 20..C")
    p.add_argument("--widths", nargs="+", metavar="KxV",
                   help="the C kernel at these (key bits)x(value bits) pairs, e.g. 3x3 3x2 2x2 (above)")
    p.add_argument("--geometry", choices=sorted(GEOMETRIES), default="smollm2", help="--widths: the model's heads")
    p.add_argument("--against", metavar="REV", help="--widths: also the kernel at git revision REV, alternately")
    args = p.parse_args()
    out = []
    if args.widths:
        pairs = [tuple(int(b) for b in w.split("x")) for w in args.widths]
        for B in args.batch:
            print(json.dumps(widths(B, args.context, pairs, args.geometry, args.against)), flush=True)
        return
    if args.kernel:
        for B in args.batch:
            print(json.dumps(kernel(B, args.context, args.bits, args.ragged)), flush=True)
        return
    if args.paths:
        torch.set_num_threads(1)
        for B in args.batch:
            print(json.dumps(paths(B, args.context, args.bits, args.ragged)), flush=True)
        return
    for B in args.batch:
        torch.set_num_threads(1)
        row = {"batch": B, "context": args.context, "kvq_bits": args.bits,
               "kvq_ms_per_step": kvq_work(B, args.context, args.bits, args.steps),
               "bf16_ms_per_step": bf16_work(B, args.context, args.steps)}
        row["threads"] = threads(B, args.context, args.bits)
        out.append(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
