"""Decode-attention kernel benchmark: packed 1/2/4-bit base + fp16 overlay vs bf16 paged decode and dense SDPA.

    python bench/kernels.py            # CUDA: full sweep, contexts 1k-32k x batch 1-64, Llama-3-8B and SmolLM2 heads
    python bench/kernels.py --tiny     # any machine (CPU: TRITON_INTERPRET=1): a couple of tiny configs

Every variant runs in the same process on the same device, and so does a large device-to-device copy whose
bandwidth is the ceiling the "% of copy" column refers to. Bytes are what each kernel must move: query, output,
and for ours the packed codes, fp16 scales/zero-points, the overlay frames and the page indices (the split
workspace is not counted: it is overhead of ours, not data). max_abs_err (first config of each model): kvqN vs the
torch reference on the same packed data; torch-sdpa and sglang-triton vs our kernel / SDPA on the same 16-bit
pages, so a baseline that computes something else shows up. Results: JSON (+ PNG when matplotlib is installed)
under bench/results/ and, if set, $OUT.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from functools import partial
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("bench/kernels.py: no CUDA device and triton was imported without TRITON_INTERPRET=1")
    os.environ["TRITON_INTERPRET"] = "1"  # before any triton import: kernels run on CPU tensors

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout works without installing the package

import triton  # noqa: E402

from sgl_kvq.attention_ref import ref_decode  # noqa: E402
from sgl_kvq.kernels import decode_attention as dec  # noqa: E402
from sgl_kvq.plan import LayerKV, PagedPlan  # noqa: E402
from sgl_kvq.quant.rotation import block_hadamard  # noqa: E402

try:  # the baseline SGLang serves with; absent on the GPU machine (no sglang there)
    from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd as sglang_decode
    SGLANG_WHY = ""
except (ImportError, RuntimeError, OSError) as e:
    sglang_decode, SGLANG_WHY = None, f"{type(e).__name__}: {e}"

MODELS = {"llama3-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}  # (q heads, KV heads, head_dim)
TINY_MODELS = {"tiny-gqa": (4, 2, 64)}
G, R, VG = 64, 64, 64  # page = key group, recent window, value channel group (sgl_kvq defaults)
SGLANG_SPLITS = 8  # SGLang's default --triton-attention-num-kv-splits


def timed(fn, device, graphs: bool = True) -> float:
    """Median microseconds of fn(). CUDA: CUDA-graph replay when capturable (and `graphs`), else do_bench."""
    if device.type == "cuda" and not graphs:
        return 1e3 * triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")
    if device.type == "cuda":
        try:
            return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
        except RuntimeError:
            return 1e3 * triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    fn()
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * sorted(times)[1]


def copy_gbps(device, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    us = timed(lambda: dst.copy_(src), device)
    return 2 * nbytes / (us * 1e3)  # read + write


def build(B, ctx, Hq, Hkv, D, bits, dtype, device, gen):
    """A pool holding B requests of ctx tokens each: base pages (random codes, positive scales) then the overlay
    (R window + open page, fp16/bf16). Also the same context as plain bf16 pages and as dense [B, H, T, D]."""
    ov_len = min(ctx, R + (ctx - 1) % G + 1)
    nb, no = (ctx - ov_len) // G, math.ceil(ov_len / G)
    P, F, Dp = B * nb + 1, B * no, D * bits // 8
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device)  # noqa: E731
    kv = LayerKV(
        k_codes=torch.randint(0, 256, (P * G, Hkv, Dp), dtype=torch.uint8, device=device, generator=gen),
        k_scale=(rnd(P, Hkv, D).abs() * 0.1).half(), k_zero=(rnd(P, Hkv, D) * 0.1).half(),
        v_codes=torch.randint(0, 256, (P * G, Hkv, Dp), dtype=torch.uint8, device=device, generator=gen),
        v_scale=(rnd(P * G, Hkv, D // VG).abs() * 0.1).half(), v_zero=(rnd(P * G, Hkv, D // VG) * 0.1).half(),
        ov_k=rnd(F, G, Hkv, D).to(dtype), ov_v=rnd(F, G, Hkv, D).to(dtype), k_bits=bits, v_bits=bits)
    i32 = dict(dtype=torch.int32, device=device)
    paged = PagedPlan(
        kv_indptr=torch.arange(B + 1, **i32) * nb,
        kv_indices=(torch.randperm(P - 1, generator=gen, device=device) + 1).to(torch.int32),
        kv_last_page_len=torch.full((B,), G if nb else 0, **i32),
        ov_indptr=torch.arange(B + 1, **i32) * no, ov_indices=torch.arange(F, **i32),
        ov_last_page_len=torch.full((B,), ov_len - (no - 1) * G, **i32))
    meta = dict(base_pages=nb, overlay_frames=no)
    return kv, paged, meta


def bytes_packed(B, Hq, Hkv, D, bits, nb, no, esize):
    codes = 2 * B * nb * G * Hkv * D * bits // 8
    k_sz = B * nb * Hkv * D * 2 * 2
    v_sz = B * nb * G * Hkv * (D // VG) * 2 * 2
    overlay = 2 * B * no * G * Hkv * D * esize  # whole frames: the kernel reads full page tiles
    return codes + k_sz + v_sz + overlay + 4 * B * (nb + no) + 2 * B * Hq * D * esize


def bench_config(model, Hq, Hkv, D, B, ctx, bits_list, dtype, device, copy_bw, check):
    gen = torch.Generator(device=device).manual_seed(0)
    esize = torch.empty((), dtype=dtype).element_size()
    sm_scale = D ** -0.5
    q = torch.randn(B, Hq, D, generator=gen, device=device).to(dtype)
    out = torch.empty_like(q)
    rows = []

    def record(variant, us, nbytes, err=None):
        row = dict(model=model, batch=B, context=ctx, variant=variant, us=round(us, 2),
                   bytes=nbytes, gbps=round(nbytes / (us * 1e3), 2),
                   pct_copy=round(100 * nbytes / (us * 1e3) / copy_bw, 1))
        if err is not None:
            row["max_abs_err"] = err
        rows.append(row)
        print(f"{model:13s} B={B:3d} ctx={ctx:6d} {variant:16s} {us:10.1f} us {row['gbps']:9.2f} GB/s "
              f"{row['pct_copy']:5.1f}% copy" + (f"  err={err:.2e}" if err is not None else ""), flush=True)

    for bits in bits_list:
        kv, paged, meta = build(B, ctx, Hq, Hkv, D, bits, dtype, device, gen)
        p = dec.plan(paged, num_qo_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=G)
        us = timed(partial(dec.run, q, kv, p, sm_scale, out=out), device)
        err = (out.float() - ref_decode(q, kv, paged, sm_scale).float()).abs().max().item() if check else None
        nbytes = bytes_packed(B, Hq, Hkv, D, bits, meta["base_pages"], meta["overlay_frames"], esize)
        record(f"kvq{bits}", us, nbytes, err)
        if bits == 2:
            # KVQ_ROTATE=values: the output rotated back by the split merge (kvq_triton's fused decode) against the
            # same decode followed by the entry's [B * Hq, D] x [D, D] product (what kvq_torch's boundary does)
            rt = block_hadamard(D).T.contiguous().to(device)
            plain = out.clone()
            us = timed(partial(dec.run, q, kv, p, sm_scale, out=out, out_rotation=rt), device)
            err = (out.float() - plain.float() @ rt).abs().max().item() if check else None
            record(f"kvq{bits}-rotv-fused", us, nbytes, err)
            # kv, p bound now: the loop's `del kv, paged, p` leaves the name unbound for a late-bound lambda
            us = timed(lambda kv=kv, p=p: (dec.run(q, kv, p, sm_scale, out=out).float() @ rt).to(out.dtype), device)
            record(f"kvq{bits}-rotv-matmul", us, nbytes)
        del kv, paged, p

    # The same context as plain bf16/fp16 pages: every page an overlay frame, i.e. our kernel without dequant.
    n = math.ceil(ctx / G)
    k_pages = torch.randn(B * n, G, Hkv, D, generator=gen, device=device).to(dtype)
    v_pages = torch.randn(B * n, G, Hkv, D, generator=gen, device=device).to(dtype)
    i32 = dict(dtype=torch.int32, device=device)
    empty = torch.zeros(B + 1, **i32)
    dense = LayerKV(torch.zeros(G, Hkv, D // 4, dtype=torch.uint8, device=device),
                    torch.zeros(1, Hkv, D, dtype=torch.half, device=device),
                    torch.zeros(1, Hkv, D, dtype=torch.half, device=device),
                    torch.zeros(G, Hkv, D // 4, dtype=torch.uint8, device=device),
                    torch.zeros(G, Hkv, 1, dtype=torch.half, device=device),
                    torch.zeros(G, Hkv, 1, dtype=torch.half, device=device), k_pages, v_pages, k_bits=2, v_bits=2)
    last = ctx - (n - 1) * G
    paged = PagedPlan(empty, torch.zeros(0, **i32), torch.zeros(B, **i32), torch.arange(B + 1, **i32) * n,
                      torch.arange(B * n, **i32), torch.full((B,), last, **i32))
    p = dec.plan(paged, num_qo_heads=Hq, num_kv_heads=Hkv, head_dim=D, page_size=G)
    qo_bytes = 2 * B * Hq * D * esize
    kv_bytes = 2 * B * ctx * Hkv * D * esize + qo_bytes
    us = timed(lambda: dec.run(q, dense, p, sm_scale, out=out), device)
    ours_dense = out.clone()
    record("paged-16bit", us, 2 * B * n * G * Hkv * D * esize + 4 * B * n + qo_bytes)  # whole pages

    # torch SDPA over dense [B, H, T, D] KV (the same values)
    k_d = k_pages.view(B, n * G, Hkv, D)[:, :ctx].transpose(1, 2).contiguous()
    v_d = v_pages.view(B, n * G, Hkv, D)[:, :ctx].transpose(1, 2).contiguous()
    q4 = q.unsqueeze(2)
    sdpa = partial(torch.nn.functional.scaled_dot_product_attention, q4, k_d, v_d, scale=sm_scale, enable_gqa=True)
    us = timed(sdpa, device)
    ref = sdpa().squeeze(2)
    record("torch-sdpa", us, kv_bytes, (ours_dense.float() - ref.float()).abs().max().item() if check else None)
    del k_d, v_d

    if sglang_decode is not None:  # token-slot layout (page_size 1) over the same pages
        slots = (torch.arange(B * n, device=device)[:, None] * G + torch.arange(G, device=device)).view(B, n * G)
        kv_indices = slots[:, :ctx].reshape(-1).to(torch.int32)
        kv_indptr = torch.arange(B + 1, **i32) * ctx
        logits = torch.empty(B, Hq, SGLANG_SPLITS, D, dtype=torch.float32, device=device)
        lse = torch.empty(B, Hq, SGLANG_SPLITS, dtype=torch.float32, device=device)
        splits = torch.full((B,), SGLANG_SPLITS, **i32)
        kb, vb = k_pages.view(-1, Hkv, D), v_pages.view(-1, Hkv, D)
        fn = lambda: sglang_decode(q, kb, vb, out, kv_indptr, kv_indices, logits, lse, splits,  # noqa: E731
                                   SGLANG_SPLITS, sm_scale, 1.0, 1.0)
        us = timed(fn, device)
        record("sglang-triton", us, kv_bytes + 4 * B * ctx,
               (out.float() - ref.float()).abs().max().item() if check else None)
    return rows


def plot(rows, path: Path) -> str:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "matplotlib is not installed: no plot (the JSON has every number)"
    if not rows:
        return "no rows: no plot"
    from bench.plots import kernel_times, pyplot

    fig = kernel_times(rows)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    return f"plot: {path}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a couple of tiny configs (the only mode on CPU)")
    ap.add_argument("--bits", type=int, nargs="+", default=None)
    ap.add_argument("--dtype", choices=["bf16", "fp16"], default=None, help="default bf16 on CUDA, fp16 on CPU")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if CUDA else "cpu")
    if not CUDA and not args.tiny:
        ap.error("no CUDA device: only --tiny runs here (the Triton interpreter costs ~0.1 s per 1k keys)")
    # bf16 tl.dot is broken in the Triton interpreter: CPU runs default to fp16
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype or ("bf16" if CUDA else "fp16")]
    if args.tiny:
        models, contexts, batches, bits_list = TINY_MODELS, [200], [1, 2], args.bits or [2]
    else:
        models, contexts, batches = MODELS, [1024, 4096, 16384, 32768], [1, 8, 32, 64]
        bits_list = args.bits or [1, 2, 4]
    copy_bw = copy_gbps(device, (1 << 30) if CUDA else (64 << 20))
    name = torch.cuda.get_device_name(device) if CUDA else platform.processor() or platform.machine()
    print(f"device {name}; copy bandwidth {copy_bw:.1f} GB/s; dtype {dtype}; sglang baseline: "
          f"{'yes' if sglang_decode else 'no (' + SGLANG_WHY + ')'}", flush=True)
    rows = []
    for model, (Hq, Hkv, D) in models.items():
        for b_i, B in enumerate(batches):
            for c_i, ctx in enumerate(contexts):
                rows += bench_config(model, Hq, Hkv, D, B, ctx, bits_list, dtype, device, copy_bw,
                                     check=(b_i == 0 and c_i == 0))
    tag = ("tiny_" if args.tiny else "") + ("cuda" if CUDA else "cpu")
    result = dict(device=name, torch=torch.__version__, triton=triton.__version__, dtype=str(dtype),
                  interpreter=not CUDA, copy_gbps=round(copy_bw, 1), page_size=G, window=R, value_group=VG,
                  sglang_baseline=SGLANG_WHY or "sglang.kernels.ops.attention.decode_attention.decode_attention_fwd",
                  rows=rows)
    dirs = {args.out.resolve()} | ({Path(os.environ["OUT"]).resolve()} if os.environ.get("OUT") else set())
    for d in sorted(dirs):
        d.mkdir(parents=True, exist_ok=True)
        (d / f"kernels_{tag}.json").write_text(json.dumps(result, indent=1))
        print(f"wrote {d / f'kernels_{tag}.json'}")
        print(plot(rows, d / f"kernels_{tag}.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
