"""Benchmark: what one recovery costs as the world grows (issue 20), on real jobs.

Run:  .venv/bin/python bench/scale.py                       (W = 4 8 16 32; ~1 min per W on 2 cores)
      .venv/bin/python bench/scale.py --worlds 4 32 --repeat 10  (issue 35's check: 20 runs, interleaved)
      .venv/bin/python bench/scale.py --worlds 4 8 --json scale.json

Setup per W: a fresh embedded etcd (its counters are this job's alone), two
agents of W/2 ranks each, K = 1, a tiny state (``--state-kib`` per rank) and a
step that sleeps ``--step-sleep`` (it releases the CPU, as a GPU step does, so
W processes can share two cores), the recovery worker of ``bench/recovery.py``.
Rank 1 is SIGKILLed at step 8, once the job trains steadily; it is respawned
warm on its node.

Columns (every time from the goodput ledgers, one monotonic clock):
``resumed_s`` kill -> every rank's first step after the recovery; ``learned_s``
kill -> the last survivor's ``failure_detected`` (hop by hop before issue 20); ``left_s`` the longest
any survivor took to leave the failed generation (its ``generation_left``: issue 35, a teardown once
sat 60-70 s here);
``planned_s`` kill -> the leader's ``plan_published``; ``sockets_before`` /
``sockets_after`` the most socket descriptors of a worker (``/proc/<pid>/fd``)
before the kill and three steps after the recovery (``socket_kinds_*``: that
worker's sockets by kind: unix, listen, etcd, store, peer); ``window_cpu_s`` CPU
seconds the survivors, the replacement and the agents spent from the kill to
every rank stepping (``window_cpu_per_core_s``: divided by this machine's
cores, the least wall time that work takes here; ``window_agents_cpu_s`` the agents' share,
``replacement_cpu_s`` the replacement's whole life until then; ``bench_loop_gap_s`` the longest pause
of this bench's own polling loop meanwhile: a stall of the whole machine would show there); ``etcd_events_per_rank``
watch events etcd sent (``etcd_debugging_mvcc_events_total``) from the kill to
every rank stepping, per rank; ``etcd_kib_per_rank`` gRPC bytes etcd sent
meanwhile, per rank; ``idle_events_s`` events etcd sent per second of
failure-free training; ``peak_rss_mib`` the largest worker's peak RSS.
``--json FILE`` writes ``{"rows": [...]}`` with these keys; the table goes to
docs/benchmarks.md ("Scale") with the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _control_plane_layout import cpu_seconds  # noqa: E402
from _recovery_common import PY, WORKER, EventTail, child_env, kill_group, read_events, wait_file  # noqa: E402

from ckptless.coordinator.embedded import EmbeddedEtcd  # noqa: E402

KILL_STEP = 8
VICTIM = 1


def etcd_counters(endpoint: str) -> dict[str, float]:
    """Watch events and gRPC bytes etcd sent so far (its Prometheus endpoint)."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {"events": 0.0, "bytes": 0.0}
    for line in text.splitlines():
        if line.startswith("etcd_debugging_mvcc_events_total"):
            out["events"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("etcd_network_client_grpc_sent_bytes_total"):
            out["bytes"] += float(line.rsplit(" ", 1)[1])
    return out


def sockets_of(pid: int) -> int:
    try:
        return sum(1 for fd in os.listdir(f"/proc/{pid}/fd")
                   if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"))
    except OSError:
        return 0


def _socket_inodes(pid: int) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.append(link[8:-1])
    return out


def socket_kinds(pid: int, etcd_port: int, agent_pids: list[int]) -> dict[str, int]:
    """What a worker's sockets are: ``unix``, ``listen`` (its Gloo and store listeners), ``etcd``,
    ``store`` (to an agent's TCPStore) and ``peer`` (to another worker: Gloo pairs). ``/proc/<pid>/net``
    lists the whole network namespace; a socket is matched to its owner by inode."""
    tcp: dict[str, tuple[str, int, int]] = {}  # inode -> (state, local port, remote port)
    for proto in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{proto}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            tcp[f[9]] = (f[3], int(f[1].rsplit(":", 1)[1], 16), int(f[2].rsplit(":", 1)[1], 16))
    store_ports = set()
    for a in agent_pids:
        try:
            store_ports |= {tcp[i][1] for i in _socket_inodes(a) if i in tcp and tcp[i][0] == "0A"}
        except OSError:
            pass
    kinds: dict[str, int] = {}
    try:
        inodes = _socket_inodes(pid)
    except OSError:
        return kinds
    for i in inodes:
        if i not in tcp:
            k = "unix"
        elif tcp[i][0] == "0A":
            k = "listen"
        elif tcp[i][2] == etcd_port:
            k = "etcd"
        elif tcp[i][2] in store_ports:
            k = "store"
        else:
            k = "peer"
        kinds[k] = kinds.get(k, 0) + 1
    return kinds


def rank_pids(out: Path, world: int) -> dict[int, int]:
    """The newest process of each rank (the workers append a line at their first step)."""
    pids = {}
    for r in range(world):
        f = out / f"pids_rank{r}.jsonl"
        if f.exists():
            lines = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
            if lines:
                pids[r] = int(lines[-1]["pid"])
    return pids


def leader_events(gdir: Path) -> list[dict[str, Any]]:
    f = gdir / "leader.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines() if x.strip()] if f.exists() else []


def replacement_phases(evs: list[dict[str, Any]], out: Path, t_kill: float) -> dict[str, Any]:
    """Where the replacement's time went, from the kill (a slow recovery names its phase): ``rep_start_s``
    its ``job_start``; ``rep_adopted_s`` its ``membership_adopted`` (``rep_store_s`` / ``rep_group_s``: its store
    connect and default group in it); ``rep_built_s`` its setup's end (the worker's ``built`` line);
    ``rep_formed_s`` its ``groups_reformed``; ``wait_ahead_s`` / ``wait_arrive_s`` the longest any other rank
    waited for the transfers run ahead and at the check-in (the survivors wait for the replacement there)."""
    mine = [e for e in evs if e.get("rank") == VICTIM and e["t_monotonic"] > t_kill]

    def at(kind: str) -> dict[str, Any] | None:
        return next((e for e in mine if e["kind"] == kind), None)

    row: dict[str, Any] = {}
    for name, kind in (("rep_start_s", "job_start"), ("rep_adopted_s", "membership_adopted"),
                       ("rep_formed_s", "groups_reformed")):
        e = at(kind)
        row[name] = (e["t_monotonic"] - t_kill) if e is not None else float("nan")
    adopted = at("membership_adopted")
    row["rep_store_s"] = float(adopted["attrs"]["store_s"]) if adopted else float("nan")
    row["rep_group_s"] = float(adopted["attrs"]["group_s"]) if adopted else float("nan")
    built = [json.loads(x) for x in (out / f"built_rank{VICTIM}.jsonl").read_text().splitlines() if x.strip()] \
        if (out / f"built_rank{VICTIM}.jsonl").exists() else []
    row["rep_built_s"] = (built[-1]["t_built"] - t_kill) if built and built[-1]["t_built"] > t_kill else float("nan")
    others = [e for e in evs if e["kind"] == "groups_reformed" and e.get("rank") != VICTIM and e["t_monotonic"] > t_kill]
    row["wait_ahead_s"] = max((float(e["attrs"]["ahead_s"]) for e in others), default=float("nan"))
    row["wait_arrive_s"] = max((float(e["attrs"]["arrive_s"]) for e in others), default=float("nan"))
    return row


def run_one(world: int, state_bytes: int, step_sleep: float, work: Path, log: Any, settle: float = 3.0) -> dict[str, Any]:
    job = f"scale{world}-{uuid.uuid4().hex[:6]}"
    out = work / job
    gdir = out / "goodput"
    out.mkdir(parents=True)
    steps = KILL_STEP + 12
    env = child_env({"BENCH_STATE_BYTES": str(state_bytes), "BENCH_STEPS": str(steps),
                     "BENCH_STEP_SLEEP": str(step_sleep), "BENCH_PAUSES": f"{VICTIM}:{KILL_STEP}",
                     "CKPTLESS_LOG_LEVEL": "WARNING", "CKPTLESS_COLLECTIVE_TIMEOUT": "120",
                     "CKPTLESS_RECOVERY_TIMEOUT": "300", "CKPTLESS_NODE_GPUS": "0"})
    with EmbeddedEtcd(data_dir=out / "etcd", log_path=out / "etcd.log") as etcd:
        common = ["--nnodes", "2", "--nproc-per-node", str(world // 2), "--rdzv-id", job, "--rdzv-endpoint",
                  etcd.endpoint, "--lease-ttl", "1", "--goodput-dir", str(gdir), "--no-shm-dir"]
        procs, logs = [], []
        try:
            for i in range(2):
                lf = open(out / f"agent{i}.log", "wb")
                logs.append(lf)
                procs.append(subprocess.Popen([PY, "-m", "ckptless.launcher.main", *common, WORKER, "ckptless",
                                               str(out)], env=env, stdout=lf, stderr=subprocess.STDOUT,
                                              start_new_session=True))
            doc = wait_file(out / "pause0.json", 600, procs)
            # Steady training of the others while the victim holds: idle etcd traffic, sockets before.
            c0, t0 = etcd_counters(etcd.endpoint), time.monotonic()
            time.sleep(settle)  # the measured window (what is counted is etcd's traffic in it)
            c1 = etcd_counters(etcd.endpoint)
            idle = (c1["events"] - c0["events"]) / (time.monotonic() - t0)
            before = rank_pids(out, world)
            sockets_before = max(sockets_of(p) for p in before.values())
            etcd_port = int(etcd.endpoint.rsplit(":", 1)[1])
            agent_pids = [p.pid for p in procs]
            kinds_before = socket_kinds(max(before.values(), key=sockets_of), etcd_port, agent_pids)
            victim_pid = int(doc["pid"])
            watched = [p for p in before.values() if p != victim_pid] + agent_pids
            cpu_kill = sum(cpu_seconds(p) for p in watched)
            agents_kill = sum(cpu_seconds(p) for p in agent_pids)
            t_kill = time.monotonic()
            os.kill(victim_pid, signal.SIGKILL)
            deadline = time.monotonic() + 600
            last, gap = t_kill, 0.0  # this loop's longest pause: a stall of the whole machine shows here too
            tail = EventTail(gdir)
            while True:
                now = time.monotonic()
                gap, last = max(gap, now - last), now
                evs = tail.poll()
                done = {e["rank"] for e in evs if e["kind"] == "first_step_after_recovery"}
                if len(done) == world:
                    fresh = [p for p in rank_pids(out, world).values() if p not in before.values()]
                    window_cpu = sum(cpu_seconds(p) for p in watched + fresh) - cpu_kill
                    agents_cpu = sum(cpu_seconds(p) for p in agent_pids) - agents_kill
                    fresh_cpu = sum(cpu_seconds(p) for p in fresh)  # the replacement's whole life so far
                    break
                if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
                    raise RuntimeError(f"W={world}: the recovery did not finish")
                time.sleep(0.02)
            c2 = etcd_counters(etcd.endpoint)
            resumed = max(e["t_monotonic"] for e in evs if e["kind"] == "first_step_after_recovery") - t_kill
            learned = max(e["t_monotonic"] for e in evs if e["kind"] == "failure_detected") - t_kill
            left = max((float(e["attrs"]["seconds"]) for e in evs if e["kind"] == "generation_left"), default=float("nan"))
            plans = [e["t_monotonic"] for e in leader_events(gdir) if e["kind"] == "plan_published"]
            gen = max(e["generation"] for e in evs if e["kind"] == "first_step_after_recovery")
            target = max(e["step"] for e in evs if e["kind"] == "first_step_after_recovery") + 3
            while max((e["step"] for e in read_events(gdir) if e["kind"] == "step_done"
                       and e["generation"] == gen), default=0) < target:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"W={world}: no steps after the recovery")
                time.sleep(0.05)
            after = rank_pids(out, world)
            sockets_after = max(sockets_of(p) for p in after.values())
            kinds_after = socket_kinds(max(after.values(), key=sockets_of), etcd_port, agent_pids)
            for p in procs:
                p.wait(300)
            mem = [json.loads(f.read_text()) for f in out.glob("mem_rank*.json")]
            phases = replacement_phases(evs, out, t_kill)
            row = {"world": world, "resumed_s": resumed, "learned_s": learned, "left_s": left,
                   "planned_s": (min(plans) - t_kill) if plans else float("nan"),
                   "sockets_before": sockets_before, "sockets_after": sockets_after,
                   "socket_kinds_before": kinds_before, "socket_kinds_after": kinds_after,
                   "bench_loop_gap_s": gap, "window_cpu_s": window_cpu, "window_agents_cpu_s": agents_cpu,
                   "replacement_cpu_s": fresh_cpu, "window_cpu_per_core_s": window_cpu / len(os.sched_getaffinity(0)),
                   "etcd_events_per_rank": (c2["events"] - c1["events"]) / world,
                   "etcd_kib_per_rank": (c2["bytes"] - c1["bytes"]) / world / 1024,
                   "idle_events_s": idle, "peak_rss_mib": max(m["peak_rss"] for m in mem) / 2**20,
                   "load1": os.getloadavg()[0], **phases}
            if fresh_cpu > 0.5:  # a warm respawn spends ~0.03-0.05 s; this one imported torch itself
                log(f"W={world}: the respawn was cold ({fresh_cpu:.2f} s of CPU): the kill came before the fork "
                    "server was ready; not the scenario measured (raise --settle)")
            log(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
            return row
        finally:
            for p in procs:
                kill_group(p)
            for lf in logs:
                lf.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--state-kib", type=int, default=64)
    ap.add_argument("--step-sleep", type=float, default=0.2)
    ap.add_argument("--settle", type=float, default=3.0,
                    help="seconds of steady training before the kill (the agents' fork servers must be ready by then: "
                         "on one core at W = 32 they need ~20 s; a cold respawn shows as replacement_cpu_s > 0.5)")
    ap.add_argument("--repeat", type=int, default=1, help="run each W this many times (issue 35: 10 each at W 4 and 32)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=None,
                    help="keep each run's logs, ledgers and etcd here (default: a temporary directory, removed)")
    a = ap.parse_args()
    if any(w < 4 or w % 2 for w in a.worlds):
        ap.error("--worlds: even sizes of at least 4 (two agents of W/2 ranks)")
    rows = []
    with tempfile.TemporaryDirectory(prefix="ckptless-scale-") as tmp:
        for i in range(a.repeat):
            for w in a.worlds:
                work = (a.work or Path(tmp)) / f"try{i}"
                work.mkdir(parents=True, exist_ok=True)
                try:
                    rows.append(run_one(w, a.state_kib * 1024, a.step_sleep, work, lambda s: print(s, flush=True),
                                        a.settle))
                except RuntimeError as exc:  # a run that did not recover is a result too: counted, not hidden
                    print(f"W={w} try {i}: {exc}", flush=True)
                    rows.append({"world": w, "failed": str(exc), "load1": os.getloadavg()[0]})
    print("\n| W | kill -> resumed s | last survivor learns s | longest leave s | plan published s | sockets/worker "
          "before -> after | etcd events/rank | etcd KiB/rank | idle etcd events/s | peak RSS MiB | CPU s in the window / "
          "cores | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "failed" in r:
            print(f"| {r['world']} | FAILED: {r['failed'][:80]} | | | | | | | | | | {r['load1']:.1f} |")
            continue
        print(f"| {r['world']} | {r['resumed_s']:.2f} | {r['learned_s']:.3f} | {r['left_s']:.3f} | {r['planned_s']:.2f} | "
              f"{r['sockets_before']} -> {r['sockets_after']} | {r['etcd_events_per_rank']:.1f} | "
              f"{r['etcd_kib_per_rank']:.1f} | {r['idle_events_s']:.1f} | {r['peak_rss_mib']:.0f} | "
              f"{r['window_cpu_s']:.2f} / {r['window_cpu_s'] / r['window_cpu_per_core_s']:.0f} = {r['window_cpu_per_core_s']:.2f} | "
              f"{r['load1']:.1f} |")
    print("\nThe replacement, from the kill (s): its start, membership adopted (store connect + default group in "
          "it), setup built, groups formed; the longest any other rank waited for the transfers run ahead / at "
          "the check-in\n")
    print("| W | kill -> resumed s | start | adopted (store + group) | built | formed | others' ahead wait | "
          "others' check-in wait |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "failed" not in r:
            print(f"| {r['world']} | {r['resumed_s']:.2f} | {r['rep_start_s']:.2f} | {r['rep_adopted_s']:.2f} "
                  f"({r['rep_store_s']:.3f} + {r['rep_group_s']:.3f}) | {r['rep_built_s']:.2f} | "
                  f"{r['rep_formed_s']:.2f} | {r['wait_ahead_s']:.2f} | {r['wait_arrive_s']:.2f} |")
    if a.json is not None:
        a.json.write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
