#!/usr/bin/env bash
# Build (or refresh) the project's CPU development venv: CPU torch, sglang==0.5.23 without its CUDA-only
# dependencies, triton for TRITON_INTERPRET=1, the embedded model/data packages, and sgl-kvq editable.
# Idempotent: a stamp over the requirement files skips the work when nothing changed.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${SGL_KVQ_VENV:-$ROOT/.venv}
REQ=$ROOT/requirements
LOCK=$REQ/lock-cpu.txt
STAMP=$VENV/.sgl_kvq_setup_stamp
want=$(cat "$REQ"/*.txt "$ROOT/pyproject.toml" "$0" | sha256sum | cut -d' ' -f1)
if [[ -f $STAMP && $(cat "$STAMP") == "$want" ]]; then
  echo "setup: $VENV is up to date"; exit 0
fi
[[ -x $VENV/bin/python ]] || python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
# torch first, from the machine's CPU build; everything after is constrained to it by the lock.
"${PIP[@]}" -c "$LOCK" torch
# sglang's own metadata pins the CUDA torch build and ~20 CUDA-only packages: take the wheel alone.
"${PIP[@]}" --no-deps -c "$LOCK" sglang
"${PIP[@]}" -c "$LOCK" -r "$REQ/sglang-cpu-deps.txt" -r "$REQ/dev.txt"
"${PIP[@]}" --no-deps -c "$LOCK" -r "$REQ/data.txt"
"${PIP[@]}" --no-deps -c "$LOCK" -e "$ROOT"
# CPU import shims (sgl_kernel, torchvision): only this CPU venv sees them, through a .pth file.
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$ROOT/sgl_kvq/cpu_shims" > "$SITE/sgl_kvq_cpu_shims.pth"
"$VENV/bin/python" -c 'import sglang, torch, triton, sgl_kvq; print("setup: sglang", sglang.__version__, "torch", torch.__version__, "triton", triton.__version__)'
echo "$want" > "$STAMP"
