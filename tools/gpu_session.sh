#!/usr/bin/env bash
# One call on a lent GPU machine (issue 36): `make test-gpu` (tests/gpu: NCCL communicators made and aborted,
# the capture and restore, several ranks of real NCCL on the one GPU: tests/gpu/test_shared_gpu.py) and
# `make bench-gpu`, each with a deadline, then at most 8 files in OUT for the repository's
# docs/gpu-runs/<date>-<device>/ (the device tool brings back 8 files, 2 folders deep).
#
# Here first: tools/gpu_wheels.sh (the wheels that machine lacks, in .whl/). There, from the repository root:
#     tools/gpu_session.sh "$OUT"            (run's carry: [".whl"]; about 6 minutes)
# Without CUDA both steps say so and exit 0.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:?usage: tools/gpu_session.sh OUT}")
work=${GPU_SESSION_WORK:-/tmp/ckptless-gpu-session}
rm -rf "$work" && mkdir -p "$work/test" "$work/bench" "$out"
started=$(date +%s)
# SIGINT first: pytest then writes its JUnit XML and summary (the first session's SIGTERM left neither).
PYTEST_ADDOPTS="--basetemp=$work/test/tmp" timeout -s INT -k 20 "${TEST_GPU_S:-330}" tools/test_gpu.sh "$work/test" \
  > "$work/test/run.log" 2>&1
test_rc=$?
timeout -s INT -k 10 "${BENCH_GPU_S:-120}" tools/bench_gpu.sh "$work/bench" > "$work/bench/run.log" 2>&1
bench_rc=$?
py=${GPU_PYTHON:-python3}
"$py" -c "import torch" 2>/dev/null || py=.venv/bin/python  # (this machine, without CUDA)
"$py" - "$out/run.json" "$test_rc" "$bench_rc" "$started" <<'PY'
import json, subprocess, sys, time
import torch
v = {"test_gpu_rc": int(sys.argv[2]), "bench_gpu_rc": int(sys.argv[3]), "wall_s": round(time.time() - int(sys.argv[4])),
     "torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
try:
    v["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or "not a git checkout"
    v["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    v["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    v["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True).stdout.strip()
except Exception as exc:  # noqa: BLE001 - recorded, never fatal
    v["error"] = repr(exc)
json.dump(v, open(sys.argv[1], "w"), indent=1)
print(json.dumps(v))
PY
cp "$work/test/junit.xml" "$out/junit.xml" 2>/dev/null
tail -c 300000 "$work/test/pytest.log" > "$out/pytest.log" 2>/dev/null
cp "$work/bench/gpu.json" "$out/bench.json" 2>/dev/null
cp "$work/test/touchpoints.txt" "$out/touchpoints.txt" 2>/dev/null
tail -c 100000 "$work/bench/bench.log" > "$out/bench.log" 2>/dev/null
# Every case's JSON and the jobs' logs (small), in one archive.
tar czf "$out/cases.tgz" -C "$work" --exclude='*.pt' --exclude='*.whl' --exclude='etcd' --exclude='member' . 2>/dev/null
ls -la "$out"
tail -n 25 "$work/test/pytest.log" 2>/dev/null
exit $(( test_rc != 0 || bench_rc != 0 ))
