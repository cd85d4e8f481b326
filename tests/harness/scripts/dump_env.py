"""Dump this process's environment as JSON for launcher comparisons.

Usage (as a training script under any launcher):
    dump_env.py OUT_DIR [--argv] [--by-worker] [--wait-for N]
writes OUT_DIR/env_rank<RANK>.json containing ``dict(os.environ)``; with
``--argv`` the file is ``{"environ": {...}, "argv": sys.argv}`` instead; with
``--by-worker`` it is named after the ckptless worker id's last part
(``env_w0.json``, ``env_spare1.json``: spares have no rank of their own); with
``--wait-for N`` it then waits (at most 60 s) until N such files exist, so that
no worker ends the job before the others (spares included) have written theirs.
Reused by the ckptless-run end-to-end comparison with real torchrun.
"""

import json
import os
import sys
import time


def main() -> None:
    out_dir = sys.argv[1]
    rank = os.environ.get("RANK", "none")
    name = f"rank{rank}"
    if "--by-worker" in sys.argv[2:]:
        name = os.environ.get("CKPTLESS_WORKER_ID", "none").rsplit("/", 1)[-1]
    payload: object = dict(os.environ)
    if "--argv" in sys.argv[2:]:
        payload = {"environ": dict(os.environ), "argv": sys.argv}
    tmp = os.path.join(out_dir, f".env_{name}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(out_dir, f"env_{name}.json"))  # readers never see half a file
    if "--wait-for" in sys.argv[2:]:
        n = int(sys.argv[sys.argv.index("--wait-for") + 1])
        deadline = time.monotonic() + 60.0
        while sum(f.startswith("env_") for f in os.listdir(out_dir)) < n and time.monotonic() < deadline:
            time.sleep(0.02)


if __name__ == "__main__":
    main()
