"""Benchmark: respawn latency of one worker, cold (fresh ``python -u``) vs warm (fork server).

Run:  .venv/bin/python bench/respawn.py [--repeat 5] [--json]

A WorkerGroup runs ``python -u probe.py``; the probe's first line takes
``time.monotonic()`` (one system-wide clock), then it imports torch and
torch.distributed and takes it again, and reports both on a FIFO.  For each
mode the bench calls ``respawn(0)`` ``--repeat`` times (after the previous
incarnation exited) and measures, from the call:

* first line   - the first line of user code runs
* torch ready  - ``import torch, torch.distributed`` done (a no-op when warm)

It prints best and median of each, plus the fork server's one-time start
(from ``start()`` until it can serve).  Same machine, same run: read ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import sys
import tempfile
import time

from ckptless import environment
from ckptless.launcher.workers import WorkerGroup

PROBE = """import time; T0 = time.monotonic()
import os
import torch, torch.distributed
T1 = time.monotonic()
fd = os.open(os.environ["BENCH_FIFO"], os.O_WRONLY)
os.write(fd, f"{T0} {T1}\\n".encode())
os.close(fd)
"""


def read_line(fd: int, timeout: float = 120.0) -> str:
    buf = b""
    deadline = time.monotonic() + timeout
    while not buf.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError("probe did not report")
        buf += os.read(fd, 4096)
    return buf.decode()


def run(mode: str, repeat: int, tmp: str) -> dict[str, object]:
    fifo = os.path.join(tmp, f"{mode}.fifo")
    os.mkfifo(fifo)
    fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    probe = os.path.join(tmp, "probe.py")
    env = dict(environment.environ(), BENCH_FIFO=fifo)
    g = WorkerGroup([[sys.executable, "-u", probe]], [env], warm=mode == "warm")
    t_start = time.monotonic()
    g.start()
    read_line(fd)
    if g.wait(60) is None:
        raise RuntimeError("incarnation 0 did not exit")
    server_ready = None
    if mode == "warm":
        if not g.warm_ready(180):
            raise RuntimeError("fork server did not become ready")
        server_ready = time.monotonic() - t_start
    first, torch_ready = [], []
    try:
        for _ in range(repeat):
            t_req = time.monotonic()
            g.respawn(0)
            t0, t1 = map(float, read_line(fd).split())
            if g.wait(60) is None:
                raise RuntimeError("respawned worker did not exit")
            if g.spawned_warm(0) != (mode == "warm"):
                raise RuntimeError(f"{mode} respawn was not {mode}")
            first.append(t0 - t_req)
            torch_ready.append(t1 - t_req)
    finally:
        g.stop(10)
        os.close(fd)
    return {"mode": mode, "first_line_s": first, "torch_ready_s": torch_ready, "server_ready_s": server_ready}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="print raw samples as JSON")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="ckptless_bench_respawn_") as tmp:
        with open(os.path.join(tmp, "probe.py"), "w") as f:
            f.write(PROBE)
        results = [run(mode, args.repeat, tmp) for mode in ("cold", "warm")]
    if args.json:
        print(json.dumps(results, indent=1))
        return
    ms = 1e3
    print(f"respawn(0) -> probe, best / median of {args.repeat} (ms)")
    print(f"{'mode':6} {'first line':>18} {'torch ready':>18}")
    for r in results:
        first, ready = r["first_line_s"], r["torch_ready_s"]
        assert isinstance(first, list) and isinstance(ready, list)
        print(f"{r['mode']:6} {min(first) * ms:8.1f} / {statistics.median(first) * ms:7.1f} "
              f"{min(ready) * ms:8.1f} / {statistics.median(ready) * ms:7.1f}")
    warm = results[1]["server_ready_s"]
    assert isinstance(warm, float)
    print(f"fork server: start() -> ready {warm:.2f} s (once per agent, and after a server death)")


if __name__ == "__main__":
    main()
