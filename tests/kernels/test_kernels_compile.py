"""Compile every kernel for an NVIDIA target (sm_90) on a machine without a GPU.

The interpreter runs kernels as numpy and never lowers them, so a kernel can pass every CPU test and still fail to
compile on the GPU (layouts, reshapes, constexpr branches, fp16/bf16 dots). triton.compile with a GPUTarget runs the
real frontend, TTGIR passes, LLVM and ptxas. It runs in a subprocess because this session's kernels are built for
the interpreter (TRITON_INTERPRET=1 is read when @triton.jit runs). One config per kernel keeps it ~1 minute.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SCRIPT = textwrap.dedent('''
    import inspect
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from sgl_kvq.kernels.decode_attention_kernel import _decode_attention_kernel
    from sgl_kvq.kernels.extend_attention_kernel import _extend_attention_kernel
    from sgl_kvq.kernels.merge_state_kernel import _merge_state_kernel
    from sgl_kvq.kernels.quantize_pages_kernel import _quantize_pages_kernel
    from sgl_kvq.kernels.store_overlay_kernel import _store_overlay_kernel
    from sgl_kvq.kernels.host_rows_kernel import _gather_head_rows_kernel, _scatter_rows_kernel

    def source(fn, ptrs, consts):
        names = list(inspect.signature(fn.fn).parameters)
        sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n == "sm_scale_log2" else "i32")
               for n in names}
        return ASTSource(fn=fn, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()})

    from sgl_kvq.kernels.arg_groups import PageLists, PoolArgs, SplitParts
    from sgl_kvq.formats.gear.codec import PageCorrection
    from sgl_kvq.formats.logquant.codec import PageRows
    from sgl_kvq.formats.zipcache.codec import SalientPlane

    # tuple arguments are typed by a tuple of the same kind
    groups = dict(POOL=PoolArgs("*u8", "*fp16", "*fp16", "*u8", "*fp16", "*fp16", "*bf16", "*bf16", *["i32"] * 12),
                  PAGES=PageLists(*["*i32"] * 6))
    parts = dict(PARTS=SplitParts("*fp32", "*fp32", *["i32"] * 5))
    extras = {"": (), "gear": PageCorrection(*"*fp16 *fp16 *fp16 *fp16 *fp16 *u8 *fp16 *u8".split()),
              "logquant": PageRows("*fp16", "*fp16", "*u8"),
              "zipcache": SalientPlane(*"*fp16 *u8 *u8 *fp16 *fp16 *u8 *fp16 *fp16".split())}

    from sgl_kvq.formats import registry

    def fmt(name, sizes=()):  # the format's corrections, as the launchers pass them (kernels/format_extras.py)
        return dict(EXTRAS=extras[name]), dict(CORRECT=registry.BY_FAMILY[name or "kivi"].kernel.corrections(),
                                               SIZES=sizes)

    plan = {n: "*i32" for n in ("num_splits", "qo_indptr")}
    target = GPUTarget("cuda", 90, 32)
    jobs = []
    decode = dict(Q="*bf16", **groups, **parts, **plan)
    extend = dict(Q="*bf16", K_new="*bf16", V_new="*bf16", O="*bf16", **groups, **plan)
    for kernel, ptrs, consts, (x, fc) in [
        (_decode_attention_kernel, decode, dict(GROUP=4, BLOCK_H=16, D=128, G=64, KBITS=1, VBITS=1, VG=64), fmt("")),
        # gear2 (rank 2, one outlier per key channel and value token)
        (_decode_attention_kernel, decode, dict(GROUP=3, BLOCK_H=16, D=64, G=64, KBITS=2, VBITS=2, VG=64),
         fmt("gear", (2, 1, 1))),
        # zipcache2 (26 salient rows of 64 at 4 bits, SmolLM2's geometry)
        (_decode_attention_kernel, decode, dict(GROUP=3, BLOCK_H=16, D=64, G=64, KBITS=2, VBITS=2, VG=64),
         fmt("zipcache", (26, 4))),
        (_extend_attention_kernel, extend,
         dict(GROUP=3, GP=4, BLOCK_M=16, BLOCK_N=64, D=64, G=64, KBITS=2, VBITS=2, VG=64),
         fmt("zipcache", (26, 4))),
        (_extend_attention_kernel, {**extend, **{n: "*fp16" for n in ("Q", "K_new", "V_new", "O")}},
         dict(GROUP=3, GP=4, BLOCK_M=16, BLOCK_N=64, D=64, G=16, KBITS=2, VBITS=2, VG=32), fmt("gear", (3, 2, 3))),
        # logquant2 at W = 21 (8 row slots per page) and at the default W (1 slot)
        (_decode_attention_kernel, decode, dict(GROUP=3, BLOCK_H=16, D=64, G=64, KBITS=2, VBITS=2, VG=64),
         fmt("logquant", (8,))),
        (_extend_attention_kernel, extend,
         dict(GROUP=3, GP=4, BLOCK_M=16, BLOCK_N=64, D=64, G=64, KBITS=2, VBITS=2, VG=64),
         fmt("logquant", (1,))),
        # kivi3 (two code planes per row) at SmolLM2's geometry
        (_decode_attention_kernel, decode, dict(GROUP=3, BLOCK_H=16, D=64, G=64, KBITS=3, VBITS=3, VG=64), fmt("")),
        (_extend_attention_kernel, extend,
         dict(GROUP=3, GP=4, BLOCK_M=16, BLOCK_N=64, D=64, G=64, KBITS=3, VBITS=1, VG=64), fmt("")),  # a recipe's
    ]:
        jobs.append((kernel, {**ptrs, **x}, {**consts, **fc, "DOT_FP32": False}, {}))
    pool = dict(KC="*u8", KS="*fp16", KZ="*fp16", VC="*u8", VS="*fp16", VZ="*fp16", OVK="*bf16", OVV="*bf16")
    jobs += [
        (_quantize_pages_kernel, dict(K="*bf16", V="*bf16", src_ids="*i32", dst_pages="*i32", **pool),
         dict(G=32, D=128, VG=32, KBITS=4, VBITS=4, SPECACHE_ONE_BIT=True), dict(enable_fp_fusion=False)),
        (_quantize_pages_kernel, dict(K="*bf16", V="*bf16", src_ids="*i32", dst_pages="*i32", **pool),
         dict(G=64, D=64, VG=64, KBITS=3, VBITS=3, SPECACHE_ONE_BIT=True), dict(enable_fp_fusion=False)),
        (_merge_state_kernel, dict(O_part="*fp32", LSE_part="*fp32", num_splits="*i32", O="*bf16", LSE="*fp32",
                                   RT="*fp32"), dict(D=128, BLOCK_S=8, WRITE_LSE=True, ROTATE=False, BLOCK_J=32), {}),
        # KVQ_ROTATE=values: the output rotated back as it is merged, V rotated as it is stored
        (_merge_state_kernel, dict(O_part="*fp32", LSE_part="*fp32", num_splits="*i32", O="*bf16", LSE="*fp32",
                                   RT="*fp32"), dict(D=128, BLOCK_S=8, WRITE_LSE=False, ROTATE=True, BLOCK_J=32), {}),
        (_store_overlay_kernel, dict(K="*bf16", V="*bf16", frames="*i64", offsets="*i64", OVK="*bf16",
                                     OVV="*bf16", RV="*fp32"), dict(H=3, D=64, BLOCK_H=4, ROTATE_V=False), {}),
        (_store_overlay_kernel, dict(K="*bf16", V="*bf16", frames="*i64", offsets="*i64", OVK="*bf16",
                                     OVV="*bf16", RV="*fp32"), dict(H=8, D=128, BLOCK_H=16, ROTATE_V=True), {}),
        (_scatter_rows_kernel, dict(K="*bf16", V="*bf16", slots="*i64", HK="*bf16", HV="*bf16"),
         dict(H=8, D=128, BLOCK_H=8), {}),
        (_gather_head_rows_kernel, dict(HK="*bf16", HV="*bf16", slots="*i64", heads="*i64", out_rows="*i64",
                                        OK="*bf16", OV="*bf16"), dict(D=128), {}),
    ]
    for fn, ptrs, consts, options in jobs:
        triton.compile(source(fn, ptrs, consts), target=target, options=options)
        print("compiled", fn.__name__, flush=True)
''')


def _has_nvidia_backend() -> bool:
    from triton.backends import backends
    return "nvidia" in backends


@pytest.mark.skipif(not _has_nvidia_backend(), reason="this triton build has no NVIDIA backend")
def test_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # triton >= 3.9 warns when unset; 1 is the default the GPU machine has
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = str(root) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=root, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert r.stdout.count("compiled") == 17, r.stdout
