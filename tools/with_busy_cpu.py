"""Run a command beside one busy CPU process (a spinning Python loop), for the loaded CI run.

Why: a test that passes on an idle machine and fails on a slower or busier one
is a product bug until proven otherwise. CI runs the recovery e2e subset once
beside a process that keeps one of the two cores busy for the whole run.

    python tools/with_busy_cpu.py -- python -m pytest -q tests/e2e/test_recovery_e2e.py
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: with_busy_cpu.py -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    cmd = argv[argv.index("--") + 1:]
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
    try:
        print(f"[with_busy_cpu] busy process {spinner.pid} beside: {' '.join(cmd)}", flush=True)
        return subprocess.call(cmd)
    finally:
        os.killpg(spinner.pid, signal.SIGKILL)
        spinner.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
