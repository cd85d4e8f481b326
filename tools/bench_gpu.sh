#!/usr/bin/env bash
# `make bench-gpu GPU_OUT=DIR`: bench/gpu.py on a machine with CUDA (set up as for make test-gpu), its
# table in DIR/gpu.json and DIR/bench.log. Without CUDA it says so and exits 0.
set -euo pipefail
source "$(dirname "$0")/gpu_common.sh"
if [ "$cuda" = 0 ]; then
  exec "$base" bench/gpu.py
fi
py=$(tools/gpu_setup.sh "$base" 2> >(tee "$out/setup.log" >&2))
shift || true
set +e
PYTHONUNBUFFERED=1 "$py" bench/gpu.py --out "$out" "$@" 2>&1 | tee "$out/bench.log"
exit "${PIPESTATUS[0]}"
