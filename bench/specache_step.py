"""SpeCache decode-step latency on kvq_triton: speculative prefetch vs fetch after attention vs kivi, and how much of
the host-tier copy the compute hides.

    python bench/specache_step.py            # CUDA: Llama-3-8B / SmolLM2 heads, batch 1-64, 4k context, 1 and 2 bit
    python bench/specache_step.py --tiny     # any machine (CPU: TRITON_INTERPRET=1): tiny configs, a smoke run

One "step" is the attention of LAYERS layers over the same packed pool (the layers differ only in their host-tier
rows and prefetch buffers; the MLPs are not modelled). Variants, all eager (SpeCache's decode runs eagerly: the lanes
hook SGLang's eager forward), timed with triton.testing.do_bench in one process on one device:

  kivi             the fused decode of the real rows only (kernels/decode_attention.py)
  specache         both lanes in one kernel per layer (kernels/specache_decode.py) reading this step's prefetched
                   rows, select_topk, then the next step's prefetch of that layer on the copy stream
                   (SpeCacheState.prefetch / HostTier: one event per layer, awaited by that layer only next step)
  fetch-after      no speculation: per layer the real row's low-bit attention picks its top-k, the rows are fetched on
                   the compute stream's critical path, then the 16-bit pass runs (timing proxy: the second pass is the
                   one-lane kernel with the prefetched rows, the same reads as the real row's exact pass)
  compute-only     `specache` without the copies; copy-only: the LAYERS prefetches alone
  overlap          (compute-only + copy-only - specache) / copy-only: the share of the copy time hidden (1 = all)

Results: JSON under bench/results/ and, if set, $OUT. No number from here is claimed until a GPU run produced it.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before any triton import: kernels run on CPU tensors

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a checkout works without installing the package

import triton  # noqa: E402

from sgl_kvq.config import KVQConfig  # noqa: E402
from sgl_kvq.formats.specache import SpeCacheParams  # noqa: E402
from sgl_kvq.kernels import decode_attention as dec  # noqa: E402
from sgl_kvq.kernels import specache_decode as sd  # noqa: E402
from sgl_kvq.pool_shape import PoolShape  # noqa: E402
from sgl_kvq.specache.state import SpeCacheState  # noqa: E402

# bench/kernels.py builds the packed pool; loaded by path ("kernels" is also the repository's kernel package)
_spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "bench" / "kernels.py")
bench_kernels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_kernels)
G = bench_kernels.G

MODELS = {"llama3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}  # (q heads, KV heads, head_dim)
TINY_MODELS = {"tiny-gqa": (4, 2, 64)}


def timed(fn, device) -> float:
    """Median microseconds of fn(), eager (SpeCache's decode is not graph-captured)."""
    return bench_kernels.timed(fn, device, graphs=False)


def bench_config(model, Hq, Hkv, D, B, ctx, bits, layers, top_k, dtype, device):
    gen = torch.Generator(device=device).manual_seed(0)
    kv, paged, _ = bench_kernels.build(B, ctx, Hq, Hkv, D, bits, dtype, device, gen)
    sm_scale = D ** -0.5
    cfg = KVQConfig("specache", bits, params=SpeCacheParams(top_k=top_k))
    shape = PoolShape(layers, Hkv, D, -(-B * ctx // G), cfg)
    sc = SpeCacheState(cfg, shape, B + 1, dtype, device)
    req = torch.arange(B, device=device)
    req_to_token = (req[:, None] * ctx + torch.arange(ctx, device=device)).to(torch.int32)  # a host slot per position
    q2 = torch.randn(2 * B, Hq, D, generator=gen, device=device).to(dtype)
    own = torch.randn(B, Hkv, D, generator=gen, device=device).to(dtype)
    scores = torch.empty(B, Hq, ctx, dtype=torch.float32, device=device)
    p2 = sd.plan(paged, n_lanes=2, num_qo_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=G)
    p1 = sd.plan(paged, n_lanes=1, num_qo_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=G)
    pk = dec.plan(paged, num_qo_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=G)
    out = torch.empty(B, Hq, D, dtype=dtype, device=device)

    def topk(li):
        return sd.TopK(*sc.topk.layer(li), req, top_k)

    def kivi():
        for _ in range(layers):
            dec.run(q2[:B], kv, pk, sm_scale, out=out)

    def specache(copy=True):
        for li in range(layers):
            sc.host.wait(li)
            _, lse = sd.specache_decode(q2, own, own, kv, p2, topk(li), sm_scale, scores)
            pos = sd.select_topk(scores, lse[B:], p2.base_tokens, Hkv, top_k)
            if copy:
                sc.prefetch(li, req, pos, req_to_token)

    def fetch_after():
        for li in range(layers):
            _, lse = sd.specache_decode(q2[:B], own, own, kv, p1, None, sm_scale, scores)
            sc.prefetch(li, req, sd.select_topk(scores, lse, p1.base_tokens, Hkv, top_k), req_to_token)
            sc.host.wait(li)
            sd.specache_decode(q2[:B], own, own, kv, p1, topk(li), sm_scale, scores)

    pos0 = torch.randint(0, max(1, p2.base_tokens.min().item()), (B, Hkv, top_k), device=device, generator=gen)

    def copy_only():
        for li in range(layers):
            sc.prefetch(li, req, pos0, req_to_token)
        for li in range(layers):
            sc.host.wait(li)

    specache()  # first prefetch: every later step reads real rows
    us = {"kivi": timed(kivi, device), "specache": timed(specache, device), "fetch-after": timed(fetch_after, device),
          "compute-only": timed(lambda: specache(copy=False), device), "copy-only": timed(copy_only, device)}
    hidden = (us["compute-only"] + us["copy-only"] - us["specache"]) / us["copy-only"] if us["copy-only"] else None
    row = dict(model=model, batch=B, context=ctx, bits=bits, layers=layers, top_k=top_k,
               **{k: round(v, 1) for k, v in us.items()}, overlap=None if hidden is None else round(hidden, 3),
               specache_over_kivi=round(us["specache"] / us["kivi"], 2),
               fetch_after_over_specache=round(us["fetch-after"] / us["specache"], 2))
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny configs (the only mode on CPU)")
    ap.add_argument("--layers", type=int, default=None, help="layers per step (default 4 on CUDA, 2 tiny)")
    ap.add_argument("--top-k", type=int, default=None, help="default 64 (SpeCache's), 8 tiny")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if CUDA else "cpu")
    if not CUDA and not args.tiny:
        ap.error("no CUDA device: only --tiny runs here")
    dtype = torch.bfloat16 if CUDA else torch.float16  # bf16 tl.dot is broken in the Triton interpreter
    if args.tiny:
        models, contexts, batches, bits_list = TINY_MODELS, [200], [1, 2], [1]
        layers, top_k = args.layers or 2, args.top_k or 8
    else:
        models, contexts, batches, bits_list = MODELS, [4096], [1, 8, 32, 64], [1, 2]
        layers, top_k = args.layers or 4, args.top_k or 64
    name = torch.cuda.get_device_name(device) if CUDA else platform.processor() or platform.machine()
    print(f"device {name}; dtype {dtype}; {layers} layers per step; top-k {top_k}", flush=True)
    rows = [bench_config(m, Hq, Hkv, D, B, ctx, bits, layers, top_k, dtype, device)
            for m, (Hq, Hkv, D) in models.items() for B in batches for ctx in contexts for bits in bits_list]
    tag = ("tiny_" if args.tiny else "") + ("cuda" if CUDA else "cpu")
    result = dict(device=name, torch=torch.__version__, triton=triton.__version__, dtype=str(dtype),
                  interpreter=not CUDA, page_size=G, rows=rows)
    dirs = {args.out.resolve()} | ({Path(os.environ["OUT"]).resolve()} if os.environ.get("OUT") else set())
    for d in sorted(dirs):
        d.mkdir(parents=True, exist_ok=True)
        (d / f"specache_step_{tag}.json").write_text(json.dumps(result, indent=1))
        print(f"wrote {d / f'specache_step_{tag}.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
