#!/usr/bin/env bash
# One-shot kernel check on a CUDA machine (torch 2.11+cu130, triton 3.6, no sglang needed):
#   1. kernel tests on CUDA (fp32, fp16 and bf16 cases; bit-exact quantize-pack in every dtype) and the decode
#      metadata tests, including a real CUDA-graph capture/replay of a decode step,
#   2. the full decode benchmark sweep (bf16, bits 1/2/4, Llama-3-8B and SmolLM2 heads),
#   3. SpeCache's step latency (speculative prefetch vs fetch after attention vs kivi, batch 1-64) and the share of
#      the host-tier copy hidden behind compute (bench/specache_step.py; pinned host memory: a few GiB).
# Logs and JSON go to $OUT when set (else bench/results/). Run from anywhere: bash bench/gpu_kernel_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
DEST=${OUT:-bench/results}
mkdir -p "$DEST"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITON_INTERPRET  # compiled kernels, not the interpreter
status=0

$PY - <<'PY' 2>&1 | tee "$DEST/gpu_env.txt"
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.cuda.is_available(),
      torch.cuda.get_device_name() if torch.cuda.is_available() else "")
PY

if $PY -c "import pytest" 2>/dev/null; then
    # -p no:cacheprovider: the checkout may be read-only; --junitxml keeps per-test results; KVQ_TEST_MATRIX=all:
    # every case of the sweeps CI slices (tests/helpers/slices.py), cheap on a GPU
    KVQ_TEST_MATRIX=all $PY -m pytest -p no:cacheprovider -q tests/kernels/test_kernels_quantize.py \
        tests/kernels/test_kernels_attention.py tests/kernels/test_kernels_specache.py \
        tests/unit/test_decode_metadata.py tests/unit/test_specache_decode_metadata.py \
        tests/unit/test_specache_prefix_frames.py \
        --junitxml="$DEST/kernel_tests.xml" 2>&1 | tee "$DEST/kernel_tests.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
else
    echo "pytest is not installed here: kernel tests skipped (pip install pytest, then rerun)" | tee "$DEST/kernel_tests.log"
    status=1
fi

$PY bench/kernels.py --out "$DEST" 2>&1 | tee "$DEST/bench_kernels.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
$PY bench/specache_step.py --out "$DEST" 2>&1 | tee "$DEST/bench_specache_step.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
echo "gpu_kernel_check: exit $status; results in $DEST"
exit $status
