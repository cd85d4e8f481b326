#!/usr/bin/env bash
# Make ckptless importable by the GPU machine's own Python (the one that holds torch), without an index.
#
# That machine starts bare and is given back after the session, so everything is installed into its
# interpreter directly: the wheels in .whl/ (tools/gpu_wheels.sh fetched them here) and this tree,
# editable, without build isolation (its setuptools). Then one preflight line: what will run the tests.
# Not a nested venv: the image's python3 is itself a venv, and a venv made from it sees none of its
# packages (torch included). Usage: tools/gpu_setup.sh [PYTHON]; prints the interpreter to use.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-${GPU_PYTHON:-python3}}
if [ -d .whl ]; then "$py" -m pip install -q --no-index --no-deps --no-compile --upgrade .whl/*.whl >&2; fi
"$py" -m pip install -q --no-index --no-deps --no-build-isolation -e . >&2
"$py" - >&2 <<'PY'
import google.protobuf, grpc, torch
import ckptless.launcher.main, ckptless.state.checksum, pyetcd  # noqa: F401 - the imports a GPU run needs
print(f"gpu setup: torch {torch.__version__}, CUDA {torch.cuda.is_available()}"
      f"{' on ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else ''}, protobuf "
      f"{google.protobuf.__version__}, grpcio {grpc.__version__}")
PY
echo "$py"
