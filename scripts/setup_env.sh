#!/usr/bin/env bash
# Build (or refresh) the project's CPU development venv: CPU torch, sglang==0.5.23 without its CUDA-only
# dependencies, triton for TRITON_INTERPRET=1, the embedded model/data packages, and sgl-kvq editable.
# Every package version comes from requirements/lock-cpu.txt (used as constraints), so a fresh machine gets the
# same set as the dev venv.
# Idempotent: a stamp over the requirement files, this script, the checkout path and the interpreter skips the
# work when nothing changed (about 0.1 s). Env: KVQ_VENV (default ./.venv), KVQ_PYTHON (default python3).
set -euo pipefail

# Parsed whole before it runs (a function), so editing this file during a build cannot derail the build.
main() {
  ROOT=$(cd "$(dirname "$0")/.." && pwd)
  VENV=${KVQ_VENV:-$ROOT/.venv}
  PY=${KVQ_PYTHON:-python3}
  REQ=$ROOT/requirements
  LOCK=$REQ/lock-cpu.txt
  STAMP=$VENV/.sgl_kvq_setup_stamp
  # SGLang rewrites every SGL_* variable to SGLANG_* with a warning when it is imported: keep ours out of its way.
  unset KVQ_VENV KVQ_PYTHON

  # The lock (torch 2.13.0+cpu, sglang's Rust extensions) was frozen for CPython 3.11.
  pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  if [[ $pyver != 3.11 ]]; then
    echo "setup: $PY is Python $pyver; the locked CPU set needs 3.11 (set KVQ_PYTHON=/path/to/python3.11)" >&2
    exit 1
  fi
  # mooncake's transfer engine (PD disaggregation, requirements/pd.txt) links libibverbs.so.1 even for TCP: the
  # Debian package (about 3 s when apt works). Without it (no root, no apt) the PD engine tests skip and say so.
  if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 '; then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
      apt-get install -y -qq libibverbs1 >/dev/null 2>&1 \
        || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libibverbs1 >/dev/null 2>&1; } \
        || echo "setup: apt-get install libibverbs1 failed: the PD engine tests will skip" >&2
    else
      echo "setup: libibverbs.so.1 is missing (apt-get install libibverbs1 as root): the PD engine tests will skip" >&2
    fi
  fi
  # The checkout path is part of the stamp: the editable install and the shim .pth point into it.
  want=$({ cat "$REQ"/*.txt "$ROOT/pyproject.toml" "$0"; echo "$ROOT $pyver"; } | sha256sum | cut -d' ' -f1)
  if [[ -f $STAMP && $(cat "$STAMP") == "$want" ]] && "$VENV/bin/python" -c '' 2>/dev/null; then
    echo "setup: $VENV is up to date"; exit 0
  fi
  rm -f "$STAMP"
  t0=$SECONDS
  "$VENV/bin/python" -c '' 2>/dev/null || "$PY" -m venv --clear "$VENV"
  PIP=("$VENV/bin/python" -m pip install -qq -c "$LOCK")  # -qq: errors only (the pip config warns per package)
  # torch first: the lock pins the machine's local CPU build (pip's find-links), never the CUDA wheel from PyPI.
  "${PIP[@]}" torch || {
    echo "setup: no torch==2.13.0+cpu wheel found; this machine's pip config (find-links) should provide it" >&2
    exit 1
  }
  # sglang's own metadata pins the CUDA torch build and ~20 CUDA-only packages: take the wheel alone.
  "${PIP[@]}" --no-deps sglang
  # (pip would list every CUDA-only requirement of sglang as a conflict here: expected, so not shown.)
  "${PIP[@]}" --no-warn-conflicts -r "$REQ/sglang-cpu-deps.txt" -r "$REQ/dev.txt"
  "${PIP[@]}" --no-deps -r "$REQ/data.txt"
  "${PIP[@]}" --no-deps -r "$REQ/pd.txt"
  "${PIP[@]}" --no-deps --no-build-isolation -e "$ROOT"
  # CPU import shims (sgl_kernel, torchvision): only this CPU venv sees them, through a .pth file.
  SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$ROOT/sgl_kvq/cpu_shims" > "$SITE/sgl_kvq_cpu_shims.pth"
  "$VENV/bin/python" - <<'PY'
import sgl_kernel, sglang, torch, torchvision, triton, sgl_kvq
assert sgl_kernel.__version__.endswith("+cpushim") and torchvision.__version__.endswith("+cpushim")
print("setup: sglang", sglang.__version__, "torch", torch.__version__, "triton", triton.__version__)
PY
  echo "$want" > "$STAMP"
  echo "setup: $VENV built in $((SECONDS - t0)) s"
}

main "$@"
exit
