"""Dump this process's environment as JSON for launcher comparisons.

Usage (as a training script under any launcher):
    dump_env.py OUT_DIR [--argv]
writes OUT_DIR/env_rank<RANK>.json containing ``dict(os.environ)``; with
``--argv`` the file is ``{"environ": {...}, "argv": sys.argv}`` instead.
Reused by the ckptless-run end-to-end comparison with real torchrun.
"""

import json
import os
import sys


def main() -> None:
    out_dir = sys.argv[1]
    rank = os.environ.get("RANK", "none")
    payload: object = dict(os.environ)
    if "--argv" in sys.argv[2:]:
        payload = {"environ": dict(os.environ), "argv": sys.argv}
    tmp = os.path.join(out_dir, f".env_rank{rank}.json.tmp")
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(out_dir, f"env_rank{rank}.json"))  # readers never see half a file


if __name__ == "__main__":
    main()
