#!/usr/bin/env bash
# One call on a machine with more cores (issue 35's last clause): bench/scale.py at W = 4 and W = 32,
# interleaved, and what the machine was, into OUT (for docs/runs/<date>-scale/).
#
# Why: "kill -> resumed at W = 32 within 2x of W = 4 in every run" cannot be decided on a 2-core machine,
# where W = 32's extra time is its recovery CPU divided by the two cores (docs/benchmarks.md, "one core
# against two"). The device machine has 16 cores; the bench runs on its CPUs (Gloo), not its GPU.
#
# Here first: tools/gpu_wheels.sh (the wheels that machine lacks, in .whl/). There, from the repository root:
#     SCALE_REPEAT=5 tools/scale_session.sh "$OUT"     (run's carry: [".whl"]; about 40 s per pair on 16 cores,
#                                                      ~80 s per pair on 2)
# Here, to check the script itself: SCALE_REPEAT=1 tools/scale_session.sh /tmp/x
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:?usage: tools/scale_session.sh OUT}")
mkdir -p "$out"
# This checkout's .venv where there is one (here); on the device machine (no .venv travels) its own
# Python, with the wheels of .whl/ and this tree installed into it first (tools/gpu_setup.sh).
py=${GPU_PYTHON:-}
if [ -z "$py" ] && [ -x .venv/bin/python ]; then py=.venv/bin/python; fi
if [ -z "$py" ]; then py=$(tools/gpu_setup.sh python3 2> "$out/setup.log") || { cat "$out/setup.log"; exit 2; }; fi
{
  echo "# $(date -u +%FT%TZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), $(nproc) cores," \
       "$(free -g | awk '/Mem:/ {print $2}') GiB, python $("$py" -c 'import sys; print(sys.version.split()[0])')"
  echo "# SCALE_REPEAT=${SCALE_REPEAT:-5} $py bench/scale.py --worlds 4 32 --repeat ${SCALE_REPEAT:-5}"
  uptime
} > "$out/scale.log"
timeout -s INT -k 20 "${SCALE_S:-420}" "$py" bench/scale.py --worlds 4 32 --repeat "${SCALE_REPEAT:-5}" \
  --json "$out/scale.json" >> "$out/scale.log" 2>&1
rc=$?
uptime >> "$out/scale.log"
tail -n 30 "$out/scale.log"
exit "$rc"
