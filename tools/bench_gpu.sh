#!/usr/bin/env bash
# `make bench-gpu GPU_OUT=DIR`: bench/gpu.py on a machine with CUDA (set up as for make test-gpu), its
# table in DIR/gpu.json and DIR/bench.log. Without CUDA it says so and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-gpu-results}")
mkdir -p "$out"
base=${GPU_PYTHON:-python3}
if ! "$base" -c 'import torch' 2>/dev/null; then base=.venv/bin/python; fi
if ! "$base" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  exec "$base" bench/gpu.py
fi
py=$(tools/gpu_setup.sh "$base" 2> >(tee "$out/setup.log" >&2))
shift || true
set +e
PYTHONUNBUFFERED=1 "$py" bench/gpu.py --out "$out" "$@" 2>&1 | tee "$out/bench.log"
exit "${PIPESTATUS[0]}"
