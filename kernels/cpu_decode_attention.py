"""Launcher of the CPU decode attention kernel (cpu_decode_attention.c): compiled once per machine with the system C
compiler, loaded with ctypes, run once per layer.

    if cpu_decode_attention.available():
        o = cpu_decode_attention.decode_attention(q, layer_kv, paged_plan, sm_scale)   # [B, Hq, D] in q's dtype

Formats whose base is codes, scales and zeros only (kivi1/2/3/4: `supports`); the kernel reads the packed codes of the
pages the plan names and never builds a dequantized context. The library is cached under KVQ_CACHE_DIR keyed by the
source, the flags, the compiler and this CPU's feature flags (-march=native), built into a temporary file and
renamed, so servers starting together neither rebuild nor read a half-written file. Without a C compiler
`available()` is False and says why (`unavailable_reason`); kvq_torch then keeps its torch paths.

Why C and not more torch ops (one layer, SmolLM2, B=1, 256 tokens, 2 threads, `bench/decode_work.py --kernel`): the
torch decode is ~25 ops of 3-10 us each (gathers of 768 code rows, the word-table unpack, scale gathers, casts, the
attention), 0.47 ms against bf16's 0.24 ms for two gathers and one SDPA; this kernel does it in one call, 0.10 ms.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from sgl_kvq.env import cache_dir
from sgl_kvq.formats.registry import of_extras
from sgl_kvq.plan import LayerKV, PagedPlan
from sgl_kvq.quant.pack import packed_dim
from sgl_kvq.quant.uniform import SCALE_DTYPE

SOURCE = Path(__file__).with_name("cpu_decode_attention.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# A task reads at least this many tokens: below it the fork/join and the partial merge cost more than the split buys.
_MIN_TOKENS_PER_TASK = 256
_TASKS_PER_THREAD = 4  # several tasks per thread even out requests of different lengths (dynamic schedule)

_lib: ctypes.CDLL | None = None
_reason: str | None = None


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return ""


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_flags()]).encode())
    out_dir = cache_dir() / "cpu_kernels"
    out_dir.mkdir(parents=True, exist_ok=True)
    lib = out_dir / f"cpu_decode_attention-{key.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        r = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=300)
        if r.returncode:
            raise RuntimeError(f"{cc} failed on {SOURCE.name}: {r.stderr.strip()[-2000:]}")
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _load() -> None:
    global _lib, _reason
    if _lib is not None or _reason is not None:
        return
    cc = compiler()
    if cc is None:
        _reason = "no C compiler (cc, gcc or $CC) on PATH"
        return
    try:
        # torch is imported above, so the library's libgomp.so.1 resolves to the copy torch loaded: one OpenMP
        # runtime and thread pool.
        lib = ctypes.CDLL(str(_build(cc)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        _reason = f"building the CPU decode kernel failed: {e}"
        return
    fn = lib.kvq_cpu_decode
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p] * 16 + [ctypes.c_int] * 10
                   + [ctypes.c_long, ctypes.c_long, ctypes.c_float, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_void_p])
    _lib = lib


def available() -> bool:
    """Whether the kernel is built and loaded (the first call on a machine builds it: about 2 s)."""
    _load()
    return _lib is not None


def unavailable_reason() -> str | None:
    _load()
    return _reason


def supports(kv: LayerKV) -> bool:
    """Formats whose base is codes, scales and zeros only (PageCodec.plain_pages), on a CPU; a format whose extras
    change the dequantized K/V stays on the torch paths."""
    return of_extras(kv.extras).codec.plain_pages and kv.ov_k.device.type == "cpu"


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(f"sgl_kvq cpu decode kernel: {msg}")


def check_layer(kv: LayerKV) -> None:
    """kv against the layout the kernel indexes (its header): every buffer contiguous, on the CPU; the overlay
    frames may lie apart (pooled kivi3 frames), each contiguous, ov_k and ov_v alike."""
    F, G, H, D = kv.ov_k.shape
    _require(supports(kv), "the layer view has per-page extras or is not on the CPU")
    for what, b in (("k_bits", kv.k_bits), ("v_bits", kv.v_bits)):
        _require(b in (1, 2, 3, 4, 8), f"{what} must be 1, 2, 3, 4 or 8, got {b}")
    S, NG = kv.k_codes.shape[0], kv.v_scale.shape[-1]
    _require(S % G == 0, f"k_codes has {S} slots, not a multiple of G={G}")
    _require(NG > 0 and D % NG == 0, f"v_scale's last dim {NG} does not divide head_dim {D}")
    _require(kv.ov_k.dtype in _DTYPE_CODE, f"overlay dtype {kv.ov_k.dtype}: fp32, fp16 or bf16")
    want = {"k_codes": ((S, H, packed_dim(D, kv.k_bits)), torch.uint8),
            "v_codes": ((S, H, packed_dim(D, kv.v_bits)), torch.uint8),
            "k_scale": ((S // G, H, D), SCALE_DTYPE), "k_zero": ((S // G, H, D), SCALE_DTYPE),
            "v_scale": ((S, H, NG), SCALE_DTYPE), "v_zero": ((S, H, NG), SCALE_DTYPE),
            "ov_k": ((F, G, H, D), kv.ov_k.dtype), "ov_v": ((F, G, H, D), kv.ov_k.dtype)}
    _require(kv.ov_v.stride()[1:] == kv.ov_k.stride()[1:], "ov_k and ov_v strides within a frame differ")
    for name, (shape, dtype) in want.items():
        t = getattr(kv, name)
        whole = t[0] if name.startswith("ov_") else t  # frames may lie apart, each contiguous
        _require(tuple(t.shape) == shape and t.dtype == dtype and whole.is_contiguous() and t.device.type == "cpu",
                 f"{name}: got {tuple(t.shape)} {t.dtype} (contiguous: {t.is_contiguous()}, {t.device}), the "
                 f"kernel reads {shape} {dtype} contiguous on the CPU")


def _plan_args(plan: PagedPlan) -> list[int]:
    ts = (plan.kv_indptr, plan.kv_indices, plan.kv_last_page_len, plan.ov_indptr, plan.ov_indices,
          plan.ov_last_page_len)
    for t in ts:
        _require(t.dtype == torch.int32 and t.is_contiguous() and t.device.type == "cpu",
                 f"plan tensors must be contiguous int32 on the CPU, got {t.dtype} on {t.device}")
    return [t.data_ptr() for t in ts]


def chunk_units(plan: PagedPlan, G: int, H: int, threads: int) -> int:
    """Units (pages or frames) per task: enough tasks for every thread, none shorter than _MIN_TOKENS_PER_TASK."""
    units = plan.kv_indices.numel() + plan.ov_indices.numel()
    want = -(-units * H // (_TASKS_PER_THREAD * threads))
    return max(want, -(-_MIN_TOKENS_PER_TASK // G), 1)


def decode_attention(q: torch.Tensor, kv: LayerKV, plan: PagedPlan, sm_scale: float,
                     check: bool = True, window: int = -1) -> torch.Tensor:
    """q [B, Hq, D] (fp32, fp16 or bf16): one query per request over its context (the plan's base pages then
    overlay frames; its last window + 1 tokens under a sliding window, sgl_kvq/attention_ref.py) -> [B, Hq, D] in
    q's dtype. check=False skips check_layer for a view already checked."""
    _load()
    _require(_lib is not None, f"not available: {_reason}")
    if check:
        check_layer(kv)
    B, Hq, D = q.shape
    F, G, H, Dk = kv.ov_k.shape
    _require(Dk == D and Hq % H == 0 and B == plan.batch_size and q.dtype in _DTYPE_CODE and q.is_contiguous(),
             f"q {tuple(q.shape)} {q.dtype} against {H} KV heads of dim {Dk} and a plan of {plan.batch_size} "
             "requests (contiguous fp32/fp16/bf16)")
    threads = torch.get_num_threads()
    chunk = chunk_units(plan, G, H, threads)
    tasks = H * (B + (plan.kv_indices.numel() + plan.ov_indices.numel()) // chunk + 1)
    partial = torch.empty(tasks * (Hq // H) * (D + 2), dtype=torch.float32)
    out = torch.empty_like(q)
    rc = _lib.kvq_cpu_decode(q.data_ptr(), out.data_ptr(), kv.k_codes.data_ptr(), kv.v_codes.data_ptr(),
                             kv.k_scale.data_ptr(), kv.k_zero.data_ptr(), kv.v_scale.data_ptr(),
                             kv.v_zero.data_ptr(), kv.ov_k.data_ptr(), kv.ov_v.data_ptr(), *_plan_args(plan),
                             B, H, Hq, D, G, kv.k_bits, kv.v_bits, kv.v_scale.shape[-1], _DTYPE_CODE[q.dtype],
                             _DTYPE_CODE[kv.ov_k.dtype], kv.ov_k.stride(0), kv.ov_v.stride(0), sm_scale, window,
                             chunk, threads, partial.data_ptr())
    _require(rc == 0, "out of memory for the task table")
    return out
