"""Benchmark: a node lost with no spare anywhere: wait for the scheduler's new node, go on with
fewer ranks, or torchrun's elastic restart (issue 22). Goodput of the same job, same run.

Run:  .venv/bin/python bench/node_loss.py            (60 steps of 0.25 s, kill at step 12, new node 15 s later)
      .venv/bin/python bench/node_loss.py --quick    (40 steps, new node 10 s later)

The job (bench/_node_loss_worker.py): DDP, 2 nodes x 2 processes, a ``DistributedSampler``, each
micro-batch holding the "device" ``--micro`` seconds (a sleep, as a GPU's compute costs the host
nothing). When rank 0 logged step ``--kill-at``, the bench SIGKILLs the other node whole (its
launcher and every process under it) and, ``--delay`` seconds later, starts a new node with the same
command (what a scheduler does). Each mode runs once, one after the other, on one clock:

wait      ckptless-run --nnodes 2 (default --lost-node wait): the survivors hold in memory; the new
          node's agent arrives late, serves as spares, and takes the lost ranks, rebuilt from peers.
shrink    ckptless-run --nnodes 1:2 --lost-node shrink: the survivors go on at once, each running a
          lost rank's micro-batch too (same global batch); the new node's spares make it grow back.
torchrun  torchrun --nnodes 1:2 --max-restarts 10 (c10d rendezvous, last call 3 s): the elastic agent
          restarts the survivors' workers at world 2 from the last checkpoint (``torch.save`` every
          ``--ckpt-every`` steps), then again at world 4 when the new node joins. (The global batch
          shrinks to world 2's while it runs smaller: not the same training; the row says so.)

Reported per mode: wall time from the first step to the last, goodput = ideal / wall, where ideal
= steps x the median full-width step time of the run before the kill, and steps redone (logged
steps beyond the count: work repeated after a rollback or restart).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
WORKER = str(REPO / "bench" / "_node_loss_worker.py")
PY = sys.executable


def _env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"PYTHONPATH": str(REPO) + os.pathsep + env.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
                "BENCH_STEPS": str(args.steps), "BENCH_MICRO_S": str(args.micro),
                "BENCH_CKPT_EVERY": str(args.ckpt_every), "CKPTLESS_LOG_LEVEL": "INFO"})
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_listening(port: int, timeout_s: float, owner: subprocess.Popen[bytes]) -> None:
    """Until something accepts connections on ``port`` (bounded; fails if ``owner`` exits first)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and owner.poll() is None:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port} after {timeout_s:.0f}s")


def _steps(out: Path) -> list[dict[str, Any]]:
    f = out / "steps.jsonl"
    if not f.exists():
        return []
    return [json.loads(line) for line in f.read_text().splitlines() if line.strip()]


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc; torchrun starts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _kill(p: subprocess.Popen[bytes]) -> None:
    """The whole node at once: its launcher, and every process under it (a machine that is gone)."""
    if p.poll() is None:
        for pid in [p.pid, *_descendants(p.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        p.wait(10)


def _node_cmd(mode: str, out: Path, endpoint: str, job: str, port: int) -> list[str]:
    if mode == "torchrun":
        return [PY, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", job,
                "--rdzv-conf", "last_call_timeout=3", "--max-restarts", "10", WORKER, "torchrun", str(out)]
    flags = (["--nnodes", "1:2", "--rdzv-conf", "last_call_timeout=60", "--lost-node", "shrink"]
             if mode == "shrink" else ["--nnodes", "2"])
    return [PY, "-m", "ckptless.launcher.main", "--nproc-per-node", "2", *flags, "--rdzv-id", job,
            "--rdzv-endpoint", endpoint, "--lease-ttl", "1", WORKER, "ckptless", str(out)]


def run_mode(mode: str, args: argparse.Namespace, root: Path, endpoint: str) -> dict[str, Any]:
    out = root / mode
    out.mkdir()
    job, port = f"nodeloss-{mode}-{uuid.uuid4().hex[:6]}", _free_port()
    env = _env(args)
    if mode == "torchrun":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    nodes: list[subprocess.Popen[bytes]] = []

    def start(i: int) -> subprocess.Popen[bytes]:
        log = open(out / f"node{i}.log", "wb")
        p = subprocess.Popen(_node_cmd(mode, out, endpoint, job, port), env=env, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True, cwd=out)
        nodes.append(p)
        return p

    try:
        start(0)
        if mode == "torchrun":  # node 0 hosts the c10d store (the endpoint is its own address)
            _wait_listening(port, 60, nodes[0])
        start(1)
        deadline = time.monotonic() + 300
        while not any(s["step"] >= args.kill_at for s in _steps(out)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in nodes):
                raise RuntimeError(f"{mode}: step {args.kill_at} never came\n" + _tail(out))
            time.sleep(0.01)
        keeper = int((out / "rank0.pid").read_text())
        victim = next(p for p in nodes if keeper not in _descendants(p.pid))  # the node without rank 0
        t_kill = time.time()
        _kill(victim)  # its launcher and every worker of it, at once
        time.sleep(args.delay)
        start(2)  # the scheduler's new node, the same command
        code = next(p for p in nodes[:2] if p is not victim).wait(timeout=600)
        nodes[2].wait(timeout=120)
    finally:
        for p in nodes:
            _kill(p)
    steps = _steps(out)
    if code != 0 or not steps or max(s["step"] for s in steps) != args.steps:
        raise RuntimeError(f"{mode}: exited {code}, last step {max((s['step'] for s in steps), default=None)}\n"
                           + _tail(out))
    before = [s for s in steps if s["t"] < t_kill]
    dts = [b["t"] - a["t"] for a, b in zip(before, before[1:]) if b["step"] == a["step"] + 1]
    full = statistics.median(dts)
    first = steps[0]["t"] - full  # the first logged step ended one step after the loop began
    wall = steps[-1]["t"] - first
    ideal = args.steps * full
    return {"mode": mode, "wall_s": wall, "ideal_s": ideal, "goodput": ideal / wall, "full_step_s": full,
            "redone": sum(1 for i, s in enumerate(steps) if any(p["step"] >= s["step"] for p in steps[:i])),
            "kill_step": max(s["step"] for s in before),
            "lost_s": wall - ideal, "load": os.getloadavg()[0]}


def _tail(out: Path) -> str:
    return "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-3000:]}" for f in sorted(out.glob("node*.log")))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="40 steps, new node 10 s after the loss")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--micro", type=float, default=0.25, help="device seconds per micro-batch")
    ap.add_argument("--kill-at", type=int, default=12)
    ap.add_argument("--delay", type=float, default=15.0, help="seconds from the loss to the new node")
    ap.add_argument("--ckpt-every", type=int, default=10, help="torchrun's checkpoint interval (steps)")
    ap.add_argument("--modes", nargs="+", default=["wait", "shrink", "torchrun"],
                    choices=("wait", "shrink", "torchrun"))
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.delay = 40, 10.0
    from ckptless.coordinator.embedded import EmbeddedEtcd

    root = Path(tempfile.mkdtemp(prefix="bench-node-loss-"))
    results = []
    try:
        with EmbeddedEtcd(root / "etcd") as etcd:
            for mode in args.modes:
                r = run_mode(mode, args, root, etcd.endpoint)
                results.append(r)
                print(f"{mode}: wall {r['wall_s']:.1f} s, goodput {r['goodput']:.2f} (load avg {r['load']:.1f})",
                      flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{args.steps} steps of {args.micro} s per micro-batch, 2 nodes x 2, node 1 lost at step "
          f"{args.kill_at}, a new node {args.delay:.0f} s later; torchrun checkpoints every {args.ckpt_every} steps\n")
    print("| mode | wall (s) | ideal (s) | goodput | lost (s) | steps redone |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['mode']} | {r['wall_s']:.1f} | {r['ideal_s']:.1f} | {r['goodput']:.2f} | {r['lost_s']:.1f} | "
              f"{r['redone']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
