"""Measure ckptless's goodput under a seeded failure process, to calibrate and check ``ckptless simulate``.

Run (multi-process: only under the lock):

    flock /tmp/ckptless-heavy.lock .venv/bin/python bench/goodput_check.py \\
        --world 4 --step-s 0.2 --state-mib 16 --mtbf-s 30 --duration-s 300 --seed 1 --json run.json

Setup: a fresh embedded etcd, ``--nnodes`` agents of W / nnodes ranks each (``ckptless-run``,
K = 1, ring placement, mirror every step, no snapshots, warm respawn on the victim's node,
``--spares N`` warm spares on a spare-only agent when asked), the worker
``bench/_goodput_worker.py`` (a step that sleeps ``--step-s``: the device's time, releasing the
CPU; a shard of ``--state-mib`` per rank with its AdamW moments).

Failures: once rank 0 logged its first step (t0), a seeded Poisson process (exponential gaps of
mean ``--mtbf-s``) SIGKILLs a uniformly drawn rank's current process at each arrival. A victim
whose process is gone (still being replaced) is the new process once it logged its first step
(the arrival then waits: a kill lands on a live rank, as a real failure does). An arrival during a
recovery waits until rank 0 has stepped in the new generation (``ckptless simulate
--defer-in-recovery`` models the same): a kill in a recovery could take a lost rank's only
copy, which ends this bench's job (no snapshots) and is what the placement analysis is for.

Goodput (the simulator's definition): useful steps x the bare step / wall, over [t0, t0 + D]:
useful steps = the last step rank 0 completed by t0 + D minus its step at t0 (steps redone after
a rollback count once), the bare step = the median duration of rank 0's step body (without
ckptless's capture around it). So mirroring's cost, detection, re-formation, transfer, the lost
steps and the slower first steps are all badput. The job's own start (before t0) is outside.
``--json FILE`` writes the parameters, the kill times and the result.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _recovery_common import PY, child_env, kill_group  # noqa: E402

from ckptless.coordinator.embedded import EmbeddedEtcd  # noqa: E402

WORKER = str(Path(__file__).resolve().parent / "_goodput_worker.py")


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass  # a line being written
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def run(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    job = f"gp{a.world}-{uuid.uuid4().hex[:6]}"
    out = work / job
    out.mkdir(parents=True)
    env = child_env({"GOODPUT_STATE_BYTES": str(int(a.state_mib * 2**20)), "GOODPUT_STEP_SLEEP": str(a.step_s),
                     "CKPTLESS_LOG_LEVEL": "WARNING", "CKPTLESS_NODE_GPUS": "0"})
    rng = random.Random(a.seed)
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    kills: list[dict[str, Any]] = []
    load0 = os.getloadavg()
    t_launch = time.monotonic()  # launch -> first step (etcd, agents, imports, rendezvous): not in the window
    with EmbeddedEtcd(data_dir=out / "etcd", log_path=out / "etcd.log") as etcd:
        common = ["--nnodes", str(a.nnodes + (1 if a.spares else 0)), "--rdzv-id", job,
                  "--rdzv-endpoint", etcd.endpoint, "--goodput-dir", str(out / "goodput"), "--no-shm-dir",
                  "--replicas", "1", "--mirror-every", str(a.mirror_every)]
        try:
            agents = [["--nproc-per-node", str(a.world // a.nnodes)] for _ in range(a.nnodes)]
            if a.spares:
                agents.append(["--nproc-per-node", "0", "--spares", str(a.spares)])
            for i, extra in enumerate(agents):
                lf = open(out / f"agent{i}.log", "wb")
                logs.append(lf)
                procs.append(subprocess.Popen([PY, "-m", "ckptless.launcher.main", *common, *extra, WORKER, str(out)],
                                              env=env, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True))
                if i == 0:
                    time.sleep(1.0)  # agent 0 first: it leads (the layout is the same every run)
            deadline = time.monotonic() + 300
            while not _lines(out / "steps.jsonl"):
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError("the job did not start")
                time.sleep(0.05)
            first = _lines(out / "steps.jsonl")[0]
            t0 = first["t1"]
            step0 = first["step"]
            t_next = t0 + rng.expovariate(1.0 / a.mtbf_s)
            end = t0 + a.duration_s
            pending: int | None = None
            gate_gen = 0
            while True:
                now = time.monotonic()
                if now >= end:
                    break
                if any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"an agent exited: {[p.poll() for p in procs]}")
                if now >= t_next:
                    if pending is None:
                        pending = rng.randrange(a.world)  # one draw per arrival: the schedule is the seed's
                    pids = _lines(out / f"pids_rank{pending}.jsonl")
                    pid = int(pids[-1]["pid"]) if pids else 0
                    trained = _lines(out / "steps.jsonl")
                    gen_now = trained[-1]["gen"] if trained else 0
                    if pid and _alive(pid) and gen_now >= gate_gen:
                        os.kill(pid, signal.SIGKILL)
                        kills.append({"t": now - t0, "rank": pending, "pid": pid, "late_s": now - t_next})
                        pending = None
                        gate_gen = gen_now + 1  # the next kill lands once the job trains again (the model's
                        # --defer-in-recovery): a kill during a recovery could take a lost rank's only copy
                        t_next = t_next + rng.expovariate(1.0 / a.mtbf_s)
                        if t_next < now:
                            t_next = now + 0.5  # an arrival during a wait lands once the rank is back
                    else:
                        time.sleep(0.05)
                        continue
                time.sleep(min(0.02, max(0.0, min(t_next, end) - time.monotonic())))
            steps = [s for s in _lines(out / "steps.jsonl") if s["t1"] <= end]
        finally:
            for p in procs:
                kill_group(p)
            for lf in logs:
                lf.close()
    bodies = [s["t1"] - s["t0"] for s in steps]
    bare = statistics.median(bodies)
    last = steps[-1]["step"]
    useful = last - step0
    # steady step (with ckptless around it): median gap between consecutive steps of one generation
    gaps = [b["t1"] - a_["t1"] for a_, b in zip(steps, steps[1:]) if b["step"] == a_["step"] + 1 and b["gen"] == a_["gen"]]
    row = {"world": a.world, "nnodes": a.nnodes, "spares": a.spares, "step_s": a.step_s, "state_mib": a.state_mib,
           "mtbf_s": a.mtbf_s, "duration_s": a.duration_s, "seed": a.seed, "mirror_every": a.mirror_every,
           "kills": kills, "incidents": len(kills), "useful_steps": useful, "steps_run": len(steps),
           "bare_step_s": bare, "steady_step_s": statistics.median(gaps) if gaps else float("nan"),
           "goodput": useful * bare / a.duration_s, "load_before": load0, "load_after": os.getloadavg(),
           "generations": steps[-1]["gen"], "launch_to_first_step_s": t0 - t_launch}
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--nnodes", type=int, default=2)
    ap.add_argument("--spares", type=int, default=0)
    ap.add_argument("--step-s", type=float, default=0.2)
    ap.add_argument("--state-mib", type=float, default=16)
    ap.add_argument("--mtbf-s", type=float, default=30)
    ap.add_argument("--duration-s", type=float, default=300)
    ap.add_argument("--mirror-every", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=None, help="keep the run's logs and ledgers here")
    a = ap.parse_args()
    if a.world % a.nnodes:
        ap.error("--world must be a multiple of --nnodes")
    with tempfile.TemporaryDirectory(prefix="ckptless-goodput-") as tmp:
        row = run(a, a.work or Path(tmp))
    print(json.dumps({k: v for k, v in row.items() if k != "kills"}, indent=1))
    print(f"kills at (s): {[round(k['t'], 1) for k in row['kills']]}")
    if a.json is not None:
        a.json.write_text(json.dumps(row, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
