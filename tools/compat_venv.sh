#!/usr/bin/env bash
# The compat lane's venv (make test-compat, docs/compatibility.md): another torch, installed first and
# alone, as a user's environment already holds it; then what a user's `pip install` would do beside it
# (checked to install no torch); then ckptless (editable) with the test tools at constraints.txt's
# versions, torch excepted, and a check that torch is still the one installed first.
#
# Why torch first and unconstrained afterwards: the lane stands for a team whose cluster runs this
# torch; pyproject.toml's range must take it as it is (issue 37). torch 2.14.1 lies on this machine's
# disk for Python 3.11 (a CUDA build that runs on CPU; about 5.5 GB in the venv; pip takes it from
# disk). Usage: tools/compat_venv.sh VENV TORCH_VERSION CONSTRAINTS [PYTHON]
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$1 torch_version=$2 constraints=$3 python=${4:-python3}
py=$venv/bin/python
rm -rf "$venv"
"$python" -m venv "$venv"
"$py" -m pip install --quiet --upgrade pip
echo "compat venv: torch==$torch_version first, alone"
"$py" -m pip install --quiet "torch==$torch_version"
# What `pip install 'ckptless[data,hf,lightning]'` would install beside that torch, without any of the
# project's constraints (pyproject.toml's ranges alone): it must leave torch as it is.
"$py" -m pip install --quiet --dry-run --report "$venv/user-install.json" '.[data,hf,lightning]'
"$py" - "$venv/user-install.json" <<'PY'
import json, sys
moved = [i["metadata"]["version"] for i in json.load(open(sys.argv[1]))["install"]
         if i["metadata"]["name"].lower() == "torch"]
if moved:
    sys.exit(f"compat venv: pip install ckptless would replace the installed torch by {moved[0]}")
print("compat venv: pip install 'ckptless[data,hf,lightning]' leaves torch as installed")
PY
# torch's line out, and triton's (the CUDA build of torch pins its own triton).
grep -v -E '^(torch|triton)==' "$constraints" > "$venv/constraints.txt"
"$py" -m pip install --quiet -e '.[test]' -c "$venv/constraints.txt"
"$py" - "$torch_version" <<'PY'
import sys
from importlib.metadata import version
got = version("torch")
if got.split("+")[0] != sys.argv[1]:
    sys.exit(f"compat venv: torch is {got} after installing ckptless, not {sys.argv[1]}")
print(f"compat venv: torch {got} kept")
PY
