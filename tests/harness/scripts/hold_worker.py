"""A worker for launcher tests: announce, wait for a release file, all_reduce, exit.

usage: hold_worker.py OUT_DIR   (announces OUT_DIR/ready_rank<R>.json; waits for OUT_DIR/release)
Synchronises only on files (bounded by a deadline), never on sleeps.
"""

import json
import os
import sys
import time


def main() -> None:
    out = sys.argv[1]
    rank = int(os.environ["RANK"])
    doc = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    doc["pid"] = os.getpid()
    tmp = os.path.join(out, f".ready_rank{rank}.tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, os.path.join(out, f"ready_rank{rank}.json"))
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(out, "release")):
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.01)
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    with open(os.path.join(out, f"sum_rank{rank}"), "w") as f:
        f.write(str(int(t.item())))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
