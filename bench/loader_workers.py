"""Recovery with DataLoader worker processes against the same job without them (issue 17).

    .venv/bin/python bench/loader_workers.py [--reps 3] [--workers 2]

The reference job of the e2e tests (tests/harness/scripts/train_ref.py: 2 agents x 2 ranks,
K = 1, real etcd), its loader with ``num_workers`` = 0 and = N, rank 1 SIGKILLed at
step 5. Measured from the goodput ledgers (one monotonic clock for every process on
this host): kill -> the last rank's first step after the recovery. Before the fix the
loader workers' copies of a rank's sockets kept the failure from reaching the ranks
behind it and the job waited out the collective timeout (91 s against 4 s).
Prints one markdown row per setting: min / median over the repetitions, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from ckptless.coordinator.embedded import EmbeddedEtcd  # noqa: E402
from tests.harness.cluster import Cluster  # noqa: E402


def one(etcd: EmbeddedEtcd, root: Path, workers: int) -> float:
    out = root / f"w{workers}-{uuid.uuid4().hex[:6]}"
    out.mkdir()
    c = Cluster(etcd.endpoint, out, out.name, env={"REF_LOADER_WORKERS": str(workers), "REF_PAUSE_RANK": "1",
                                                  "REF_PAUSE_STEP": "5", "CKPTLESS_COLLECTIVE_TIMEOUT": "60"})
    gdir = out / "goodput"
    try:
        c.start_agent("--goodput-dir", str(gdir))
        c.start_agent("--goodput-dir", str(gdir))
        pid = c.paused_pid(1)
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        c.wait(timeout=300)
    finally:
        c.kill_all()
    firsts = [json.loads(line)["t_monotonic"] for f in gdir.glob("rank*.jsonl") for line in f.read_text().splitlines()
              if line.strip() and json.loads(line)["kind"] == "first_step_after_recovery"]
    return max(firsts) - t_kill


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="ckptless-bench-loader-") as tmp:
        root = Path(tmp)
        with EmbeddedEtcd(data_dir=root / "etcd", log_path=root / "etcd.log") as etcd:
            got: dict[int, list[float]] = {0: [], args.workers: []}
            for _ in range(args.reps):  # interleaved, so drift hits both settings alike
                for w in got:
                    got[w].append(one(etcd, root, w))
                    print(f"num_workers={w}: kill -> last first step {got[w][-1]:.2f} s", flush=True)
    base = statistics.median(got[0])
    print(f"\nload average {load0:.1f} -> {os.getloadavg()[0]:.1f}\n")
    print("| loader workers | kill -> last rank's first step, min / median s | vs num_workers=0 |")
    print("|---|---|---|")
    for w, xs in got.items():
        print(f"| {w} | {min(xs):.2f} / {statistics.median(xs):.2f} | {statistics.median(xs) / base:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
