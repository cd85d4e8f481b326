#!/usr/bin/env bash
# `make test-gpu GPU_OUT=DIR`: the GPU checks (issues 19 and 36), results and timings in DIR.
#
# On a machine with CUDA: tools/gpu_setup.sh makes ckptless importable by the machine's own Python
# (no index there), then the tests in tests/gpu and the CUDA cases of the unit suite run, with JUnit
# XML, the pytest log and every case's JSON in DIR. Without CUDA every GPU test is collected and
# skipped (exit 0), with this checkout's .venv.
set -euo pipefail
source "$(dirname "$0")/gpu_common.sh"
tests=(tests/gpu tests/unit/test_state_restore.py -k "gpu or cuda")
if [ "$cuda" = 0 ]; then
  echo "test-gpu: no CUDA device here; the GPU tests are collected and skipped" | tee "$out/skipped.txt"
  exec "$base" -m pytest -q -p no:cacheprovider "${tests[@]}"
fi
py=$(tools/gpu_setup.sh "$base" 2> >(tee "$out/setup.log" >&2))
# pytest-xdist (in that machine's image): the cases run 4 at a time, those that share a module fixture (a
# fault-free run) on one worker (--dist loadgroup); the machine has 16 cores and the device time is short.
par=()
if "$py" -c 'import xdist' 2>/dev/null; then par=(-n 4 --dist loadgroup); fi
set +e
# -v: each result's name as it comes (under xdist -q prints only a progress line: a run stopped at its
# deadline named nothing).
PYTHONUNBUFFERED=1 CKPTLESS_GPU_OUT="$out" "$py" -m pytest -v -p no:cacheprovider "${par[@]}" "${tests[@]}" \
  --junitxml "$out/junit.xml" --durations=0 2>&1 | tee "$out/pytest.log"
rc=${PIPESTATUS[0]}
# The private torch attributes ckptless touches, probed on this machine's torch (docs/compatibility.md: the
# GPU machine's torch is the one version no CPU lane here holds).
"$py" -m tests.harness.torch_touchpoints > "$out/touchpoints.txt" 2>&1 || true
exit "$rc"
