#!/usr/bin/env bash
# `make test-gpu GPU_OUT=DIR`: the GPU checks of issue 19, results and timings in DIR.
#
# On a machine with CUDA: a virtual environment over the machine's own torch (--system-site-packages),
# the wheels from .whl/ (tools/gpu_wheels.sh fetches them where an index is reachable) and this tree
# (editable, no index), then the tests in tests/gpu and the CUDA cases of the unit suite, with JUnit
# XML, the pytest log and every case's JSON in DIR. Without CUDA every GPU test is skipped (exit 0).
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:-gpu-results}")
mkdir -p "$out"
base=${GPU_PYTHON:-python3}
if ! "$base" -c 'import torch' 2>/dev/null; then base=.venv/bin/python; fi
tests=(tests/gpu tests/unit/test_state_restore.py -k "gpu or cuda")
if ! "$base" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "test-gpu: no CUDA device here; the GPU tests are collected and skipped" | tee "$out/skipped.txt"
  exec "$base" -m pytest -q -p no:cacheprovider "${tests[@]}"
fi
venv=${GPU_VENV:-/tmp/ckptless-gpu-venv}
[ -x "$venv/bin/python" ] || "$base" -m venv --system-site-packages "$venv"
if [ -d .whl ]; then "$venv/bin/python" -m pip install -q --no-index --no-deps --no-compile .whl/*.whl; fi
"$venv/bin/python" -m pip install -q --no-index --no-deps --no-build-isolation -e .
"$venv/bin/python" -c 'import torch; print("torch", torch.__version__, "on", torch.cuda.get_device_name(0))' | tee "$out/device.txt"
set +e
PYTHONUNBUFFERED=1 CKPTLESS_GPU_OUT="$out" "$venv/bin/python" -m pytest -q -p no:cacheprovider "${tests[@]}" \
  --junitxml "$out/junit.xml" --durations=0 2>&1 | tee "$out/pytest.log"
exit "${PIPESTATUS[0]}"
