# Sourced by tools/test_gpu.sh and tools/bench_gpu.sh: the results folder, the Python that holds torch,
# and whether it sees a GPU. Sets: out (from $1), base (GPU_PYTHON, else python3, else this .venv), cuda.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=$(realpath -m "${1:-gpu-results}")
mkdir -p "$out"
base=${GPU_PYTHON:-python3}
if ! "$base" -c 'import torch' 2>/dev/null; then base=.venv/bin/python; fi
cuda=0
if "$base" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then cuda=1; fi
