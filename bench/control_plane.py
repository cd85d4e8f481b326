"""Benchmark: the control plane of one recovery at 1,000 - 10,000 ranks (issue 20), on a real etcd.

Run (takes the e2e lock: it starts etcd and many processes; one W at a time stays under 10 min):
    flock /tmp/ckptless-e2e.lock timeout 600 .venv/bin/python bench/control_plane.py \
        --worlds 1000 --ranks-per-node 8 --json cp.json --append
    .venv/bin/python bench/control_plane.py --plan-only --worlds 1000 2000 5000 10000   (no etcd)

What it emulates. A job of W ranks on N = ceil(W / L) nodes (L = ``--ranks-per-node``), K = 1, ring
placement, training at generation 0 with version 1000 committed everywhere; then one SIGKILL (rank
``--victim``). No training runs (no torch work, no groups, no transfers): what is measured is the
coordination, from the kill's exit record to every worker knowing the next generation.

What is real (the product's code, unchanged; bench/_control_plane_node.py):
* the embedded etcd (``EmbeddedEtcd``), fresh per W (its counters are this run's alone), its data
  on tmpfs (``--etcd-dir``; this VM's disk stalled fdatasync for up to 9 s under other jobs' writes);
* generation 0 as the rendezvous publishes it: the closed round and ``write_initial_membership``;
* N agents in ``--agent-procs`` processes: each its own etcd client, a lease ``Session`` (TTL
  ``--lease-ttl``, ``ckptless-run``'s default 2 s), ``Rendezvous.register``, the membership follower's
  watch on ``job/``, the exit record through the agent's ``Outbox`` and, when the plan respawns a rank
  on its node, a new worker under the planned id;
* W workers in ``--procs`` processes: one ``WorkerControl`` each (its own etcd client and TCP
  connection, its watch of ``job/``); at start ``mark_ported`` and ``wait_membership(-1)`` (the join);
  at the incident a ``report`` of what it holds (its image at v1000; v999 and v1000 of each owner it
  mirrors), then ``wait_membership``; in phase 2 ``mark_ready``;
* the leader: ``RecoveryLeader`` as ``launcher/agent.py _start_leader`` builds it (election, machine,
  ``plan_from_view``, the fenced publish), in this driver process with its own client and lease.
Set-up is complete before the kill; processes synchronise on JSON-line messages and the leader's
hooks, each wait with a deadline.

What the load generator changes (the product's code is untouched): the worker processes run
SCHED_IDLE (``--worker-nice`` for a niceness instead): on 2 cores, thousands of worker threads must
not starve etcd, the leader and the agents, which in a real job run on machines of their own; gRPC
gets one TCP connection per client (its default shares one per process); gRPC Python's wake-up slice
for blocked calls goes from 0.1 s to ``--grpc-wait-slice`` (1 s) in the emulation processes: every
watch's reader thread wakes that often to let signal handlers run, which costs a real worker nothing
and 2,000 emulated ones a whole core.

Columns (seconds from the exit record's put, one monotonic clock across processes):
``incident_s`` -> the leader put ``incident/g0``; ``reported_s`` -> the last survivor's report was
written; ``planned_s`` -> the new generation was published (the leader's ``plan_published``);
``plan_compute_s`` one ``plan_from_view`` on the same facts, timed after the run; ``notified_s`` ->
the last survivor's ``wait_membership`` returned; ``replacement_s`` -> the respawned rank's did;
``formed_s`` from phase 2's start (every worker marks itself ready) to the leader's ``every rank
resumed``; ``etcd_events_per_rank`` watch events etcd sent (``etcd_debugging_mvcc_events_total``) from
the kill to the last notification, per rank, and ``etcd_kib_per_rank`` gRPC bytes it sent; ``cpu_s``
CPU seconds of the emulation processes + this driver (the leader) + etcd in that window (the three
also apart); ``load1`` the load average after the row (it counts runnable threads: thousands here).
In the JSON also: ``etcd_probe_max_s`` etcd's slowest answer to a trivial read meanwhile,
``lease_expiries``, ``idle_emulation_cpu`` (CPU seconds per second the emulation burns with nothing
failing), ``idle_kib_s``, threads and RSS per worker. On 2 cores the emulation's own CPU is part of
every latency: read ``cpu_s`` with them, and ``plan_compute_s`` / ``observe_s`` as the leader's own
cost. A W that cannot be emulated here gets a row with ``error`` saying why. ``--plan-only`` times
the leader's planning on the same records without etcd, to any W.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# This process forks etcd and the emulation processes while gRPC threads run: like launcher/main.py,
# turn gRPC's fork handlers off (with them on, a child could abort between fork and exec, EBADF on
# the parent's epoll fd: grpc/grpc#43055), before any client starts gRPC.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from _control_plane_layout import (  # noqa: E402
    Lateness,
    Layout,
    Probe,
    pin,
    cpu_seconds,
    etcd_counters,
    thread_limit,
    threads_in_use,
    write_held,
)
from _control_plane_leader import (  # noqa: E402
    LeaderHarness,
    default_lease_ttl,
    describe_plan,
    offline_planning,
    published,
    time_planning,
)
from _control_plane_procs import Emulators, split  # noqa: E402

from ckptless.coordinator.client import EtcdClient, Put  # noqa: E402
from ckptless.coordinator.config import EtcdConfig  # noqa: E402
from ckptless.coordinator.embedded import EmbeddedEtcd, free_port  # noqa: E402
from ckptless.coordinator.keyspace import Keyspace  # noqa: E402
from ckptless.recovery.leader import write_initial_membership  # noqa: E402
from ckptless.recovery.wire import membership_to_json  # noqa: E402

#: OS threads one emulated worker needs without the relays: WorkerControl's etcd watch (pyetcd's
#: stream reader, gRPC's two stream threads, ckptless's watch supervisor) and the worker's own thread
#: (measured: 200 WorkerControls in one process hold 800 threads); relayed: the subscription's reader
#: and its own thread. An agent: the same watch plus its lease keepalive, and relaying, one reader per
#: worker of its node and the relay's writer and acceptor.
THREADS_PER_WORKER = 5
THREADS_PER_RELAYED_WORKER = 2
THREADS_PER_AGENT = 5


def _ranks(workers: list[dict[str, Any]], key: str) -> list[float]:
    return [w[key] for w in workers if key in w]


def run_world(world: int, per_node: int, procs: int, agent_procs: int, worker_nice: int | None, lease_ttl: float,
              victim: int, budget_s: float, etcd_parent: str | None, wait_slice: float | None,
              etcd_cpu: int | None, relay: bool, work: Path, say: Any) -> dict[str, Any]:
    layout = Layout(world, per_node, f"cp{world}-{uuid.uuid4().hex[:6]}")
    n = layout.n_nodes
    row: dict[str, Any] = {"world": world, "agents": n, "per_node": per_node, "procs": min(procs, n),
                           "agent_procs": min(agent_procs, n), "worker_sched": "idle" if worker_nice is None else f"nice {worker_nice}",
                           "etcd_dir": etcd_parent or "work dir",
                           "grpc_wait_slice": wait_slice or 0.1, "etcd_cpu": etcd_cpu, "relay": relay}
    per_worker = THREADS_PER_RELAYED_WORKER if relay else THREADS_PER_WORKER
    need = world * per_worker + n * (THREADS_PER_AGENT + (per_node + 2 if relay else 0)) + 200
    room = thread_limit() - threads_in_use()
    if need > room:
        row["error"] = (f"needs about {need} OS threads ({per_worker} per emulated worker, "
                        f"{THREADS_PER_AGENT} per agent and its relay's); the kernel allows "
                        f"{thread_limit()} tasks (pid_max/threads-max) and {threads_in_use()} are in use")
        say(json.dumps(row))
        return row
    out = work / layout.job_id
    out.mkdir(parents=True)
    deadline = time.monotonic() + budget_s
    ks = Keyspace(layout.job_id)
    etcd_dir = Path(tempfile.mkdtemp(prefix=f"ckptless-cp-etcd{world}-", dir=etcd_parent)) if etcd_parent else out / "etcd"
    etcd = EmbeddedEtcd(data_dir=etcd_dir, log_path=out / "etcd.log")
    emus: Emulators | None = None
    probe: Probe | None = None
    lateness = Lateness()
    leader: LeaderHarness | None = None
    client: EtcdClient | None = None
    try:
        etcd.start()
        assert etcd.pid is not None
        if etcd_cpu is not None:  # etcd alone on its CPU, as on a machine of its own
            pin(etcd.pid, {etcd_cpu})
        client = EtcdClient(EtcdConfig((etcd.endpoint,)))
        t = time.perf_counter()
        held = layout.held()
        row["setup_placement_s"] = time.perf_counter() - t
        write_held(out / "held.json", held)
        emus = Emulators(out)

        def args(role: str, nodes: tuple[int, int]) -> list[str]:
            return ["--role", role, "--endpoint", etcd.endpoint, "--job", layout.job_id, "--world", str(world),
                    "--per-node", str(per_node), "--nodes", str(nodes[0]), str(nodes[1]),
                    "--held", str(out / "held.json"), "--victim", str(victim), "--lease-ttl", str(lease_ttl),
                    "--deadline-s", str(max(30.0, deadline - time.monotonic())),
                    *(["--grpc-wait-slice", str(wait_slice)] if wait_slice else []),
                    *(["--relay-dir", str(out / "relay")] if relay else []),
                    *(["--idle"] if role == "workers" and worker_nice is None else
                      ["--nice", str(worker_nice if role == "workers" and worker_nice is not None else 0)])]

        # The agents first: they register their nodes (the rendezvous), in processes of their own.
        agent_slices = split(n, agent_procs)
        agent_idx = emus.start([args("agents", sl) for sl in agent_slices])
        agents_up = emus.expect("up", deadline, agent_idx)
        # Every node joined: the round closes and node rank 0 writes generation 0.
        m0 = layout.membership(free_port())
        client.txn([], [Put(ks.rdzv_state, layout.round_state().to_bytes())])
        write_initial_membership(client, ks, m0, round_=0, writer=True, deadline=deadline)
        row["membership0_kib"] = len(membership_to_json(m0)) / 1024
        leader = LeaderHarness(etcd.endpoint, ks, lease_ttl, m0.store_port)
        leader.start(deadline)
        # The workers: each joins generation 0 (mark_ported, wait_membership(-1)) and waits to train.
        t = time.monotonic()
        worker_slices = split(n, procs)
        worker_idx = emus.start([args("workers", sl) for sl in worker_slices])
        workers_up = emus.expect("up", deadline, worker_idx)
        row["setup_workers_s"] = time.monotonic() - t
        row["rss_kib_per_worker"] = sum(d["rss_kib"] - d["base"]["rss_kib"] for d in workers_up) / world
        row["threads_per_worker"] = sum(d["threads"] - d["base"]["threads"] for d in workers_up) / world
        row["threads"] = sum(d["threads"] for d in agents_up + workers_up)
        row["sockets"] = sum(d["sockets"] for d in agents_up + workers_up)
        probe = Probe(EtcdClient(EtcdConfig((etcd.endpoint,))))
        # Nothing failing: what etcd sends per second (lease keepalives, the leader's re-reads).
        pids = emus.pids
        c0, t0, u0 = etcd_counters(etcd.endpoint), time.monotonic(), sum(cpu_seconds(p) for p in pids)
        threading.Event().wait(2.0)  # the measured window, not a synchronisation
        c1, t1, u1 = etcd_counters(etcd.endpoint), time.monotonic(), sum(cpu_seconds(p) for p in pids)
        row["idle_events_s"] = (c1["events"] - c0["events"]) / (t1 - t0)
        row["idle_kib_s"] = (c1["bytes"] - c0["bytes"]) / (t1 - t0) / 1024
        row["idle_emulation_cpu"] = (u1 - u0) / (t1 - t0)  # CPU seconds per second, nothing failing
        row["idle_etcd_probe_max_s"] = probe.worst(t0, t1)
        if not leader.leader.is_leader.is_set() or leader.session.done.is_set():
            raise RuntimeError("the leader lost its lease while the job was set up (see the log above)")
        cpu0 = ([cpu_seconds(p) for p in pids], cpu_seconds(os.getpid()), cpu_seconds(etcd.pid))
        home = layout.node_of(victim)
        dies = [worker_idx[i] for i, (a, b) in enumerate(worker_slices) if a <= home < b]
        reaps = [agent_idx[i] for i, (a, b) in enumerate(agent_slices) if a <= home < b]
        emus.send("die", dies)
        emus.expect("died", deadline, dies)
        emus.send("reap", reaps)
        t_kill = row["t_kill"] = emus.expect("killed", deadline, reaps)[0]["t"]
        t_inc, _ = leader.wait_event("incident_opened", deadline)
        t_plan, _ = leader.wait_event("plan_published", deadline)
        notes = emus.expect("notified", deadline)
        row["lease_expiries"] = sum(ln.startswith("session ") or "lease" in ln and ("expired" in ln or "presumed lost" in ln)
                                    for f in out.glob("emulator*.log") for ln in f.read_text(errors="replace").splitlines())
        c2 = etcd_counters(etcd.endpoint)
        row["etcd_probe_max_s"] = probe.worst(t_kill, time.monotonic())  # etcd's slowest answer meanwhile
        # How long a thread of the leader's process, of an agents process, of a workers process waited
        # for a CPU at worst meanwhile (a 50 ms sleep's lateness).
        row["late_leader_s"] = lateness.worst(t_kill)
        late = [max((d for t, d in n["late"] if t >= t_kill), default=0.0) for n in notes]
        row["late_agents_s"] = max(late[i] for i in agent_idx)
        row["late_workers_s"] = max(late[i] for i in worker_idx)
        cpu1 = ([cpu_seconds(p) for p in pids], cpu_seconds(os.getpid()), cpu_seconds(etcd.pid))
        workers = [w for d in notes for w in d["workers"]]
        survivors = [w for w in workers if "reported" in w]
        fresh = [w for w in workers if "started" in w]
        if not all(d["ok"] for d in notes) or any(w.get("generation") != 1 for w in workers):
            bad = [w for w in workers if w.get("generation") != 1][:5]
            raise RuntimeError(f"not every worker saw generation 1: {bad}")
        row.update({
            "incident_s": t_inc - t_kill,
            "reported_s": max(_ranks(survivors, "reported")) - t_kill,
            "first_seen_s": min(_ranks(survivors, "seen")) - t_kill,
            "planned_s": t_plan - t_kill,
            "notified_s": max(_ranks(survivors, "notified")) - t_kill,
            "replacement_s": max(_ranks(fresh, "notified")) - t_kill if fresh else None,
            "etcd_events_per_rank": (c2["events"] - c1["events"]) / world,
            "etcd_kib_per_rank": (c2["bytes"] - c1["bytes"]) / world / 1024,
            "etcd_puts": c2["puts"] - c1["puts"], "etcd_ranges": c2["ranges"] - c1["ranges"],
            "etcd_txns": c2["txns"] - c1["txns"],
            "worker_events_per_rank": sum(w["events"] for w in survivors) / max(1, len(survivors)),
            "cpu_workers_s": sum(cpu1[0]) - sum(cpu0[0]), "cpu_leader_s": cpu1[1] - cpu0[1],
            "cpu_etcd_s": cpu1[2] - cpu0[2],
        })
        row["cpu_s"] = row["cpu_workers_s"] + row["cpu_leader_s"] + row["cpu_etcd_s"]
        m1 = published(client, ks)
        row["membership1_kib"] = len(membership_to_json(m1)) / 1024
        row.update(describe_plan(m1))
        # Phase 2: every worker resumed in generation 1 (ready marks); the leader reads them all.
        t = time.monotonic()
        emus.send("ready")
        emus.expect("marked", deadline)
        row["formed_s"] = leader.wait_line("every rank resumed", deadline) - t
        row.update(time_planning(client, ks, layout, m0, frozenset(row.get("lost", [victim])), leader.config))
        row["leader_warnings"] = leader.warnings()[:6]
    except Exception as exc:  # noqa: BLE001 - one W's failure is a row that says why; the next W still runs
        row["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        if leader is not None:
            row["leader_log"] = leader.tail()
        row["emulator_logs"] = [f.read_text(errors="replace")[-600:] for f in sorted(out.glob("emulator*.log"))
                                if f.stat().st_size][:3]
    finally:
        lateness.stop.set()
        if probe is not None:
            probe.close()
            row["etcd_probe_slow"] = probe.slow(row.get("t_kill", 0.0))[:40]
            probe.client.close()
        if leader is not None:
            leader.close()
        if emus is not None:
            emus.stop()
        if client is not None:
            client.close()
        etcd.close()
        if etcd_parent:
            shutil.rmtree(etcd_dir, ignore_errors=True)
    row["load1"] = os.getloadavg()[0]
    say(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}))
    return row


def _f(v: Any, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| W | agents | procs | kill -> incident s | -> last report s | -> plan published s | plan compute s "
            "| -> all notified s | -> replacement s | formed s | etcd events/rank | etcd KiB/rank "
            "| CPU s: all (workers / leader / etcd) | load1 |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        if "error" in r and "notified_s" not in r:
            lines.append(f"| {r['world']} | {r['agents']} | {r.get('procs', '-')} | not measured: {r['error'][:300]} "
                         "| | | | | | | | | | |")
            continue
        lines.append(
            f"| {r['world']} | {r['agents']} | {r['procs']} | {_f(r['incident_s'], '.3f')} | {_f(r['reported_s'])} "
            f"| {_f(r['planned_s'])} | {_f(r.get('plan_compute_s'), '.3f')} | {_f(r['notified_s'])} "
            f"| {_f(r.get('replacement_s'))} | {_f(r.get('formed_s'))} | {_f(r['etcd_events_per_rank'], '.1f')} "
            f"| {_f(r['etcd_kib_per_rank'], '.1f')} | {_f(r['cpu_s'], '.1f')} ({_f(r['cpu_workers_s'], '.1f')} / "
            f"{_f(r['cpu_leader_s'], '.1f')} / {_f(r['cpu_etcd_s'], '.1f')}) | {_f(r['load1'], '.1f')} |")
    return "\n".join(lines)


def _meta() -> dict[str, Any]:
    repo = Path(__file__).resolve().parents[1]

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=repo, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--", "ckptless", "launcher")),
            "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "argv": sys.argv[1:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1000, 2000])
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--procs", type=int, default=4, help="processes holding the workers (4-16)")
    ap.add_argument("--agent-procs", type=int, default=2, help="processes holding the agents")
    ap.add_argument("--worker-nice", type=int, default=None,
                    help="run the worker processes at this niceness instead of SCHED_IDLE (the default)")
    ap.add_argument("--lease-ttl", type=float, default=default_lease_ttl())
    ap.add_argument("--victim", type=int, default=1, help="the rank that is killed")
    ap.add_argument("--budget-s", type=float, default=540.0, help="deadline of one W, set-up included")
    ap.add_argument("--etcd-dir", default="/dev/shm" if os.access("/dev/shm", os.W_OK) else None,
                    help="where etcd keeps its data (default /dev/shm: tmpfs; '' for the work directory's disk)")
    ap.add_argument("--grpc-wait-slice", type=float, default=1.0,
                    help="gRPC Python's wake-up slice in the emulation processes (its default: 0.1 s; 0 keeps it)")
    ap.add_argument("--etcd-cpu", type=int, default=-1,
                    help="give etcd this CPU alone and run everything else on the others (default -1: no pinning; "
                         "with 2 CPUs pinning starved the agents on the one left)")
    ap.add_argument("--no-relay", action="store_true",
                    help="every worker watches etcd itself (before the node relays; ckptless-run always relays)")
    ap.add_argument("--plan-only", action="store_true",
                    help="no etcd, no emulation: time the leader's planning on the same records at each W")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--work", type=Path, default=None, help="keep each W's etcd and emulator logs here")
    ap.add_argument("--append", action="store_true", help="keep --json's other rows (a W measured again replaces its row)")
    a = ap.parse_args()
    if any(w < 2 * a.ranks_per_node or a.victim >= w for w in a.worlds):
        ap.error("--worlds: at least two nodes' worth of ranks, and more than --victim")

    def on_term(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)  # `timeout` sends SIGTERM: the finally blocks clean up

    signal.signal(signal.SIGTERM, on_term)
    cpus = os.sched_getaffinity(0)
    etcd_cpu = a.etcd_cpu if a.etcd_cpu is not None and a.etcd_cpu >= 0 and len(cpus) > 1 else None
    if etcd_cpu is not None:  # before any thread or child starts: they all inherit the rest
        os.sched_setaffinity(0, cpus - {etcd_cpu})
    if a.plan_only:
        plans = [offline_planning(Layout(w, a.ranks_per_node, f"plan{w}"), a.victim) for w in a.worlds]
        print("| W | agents | decode view s | plan_from_view s | one leader step s | ring placement s | facts KiB "
              "| membership KiB | a worker decodes it ms |")
        print("|---|---|---|---|---|---|---|---|---|")
        for p in plans:
            print(f"| {p['world']} | {p['agents']} | {p['view_parse_s']:.3f} | {p['plan_compute_s']:.3f} "
                  f"| {p['observe_s']:.3f} | {p['placement_s']:.3f} | {p['facts_kib']:.0f} "
                  f"| {p.get('membership1_kib', 0):.1f} | {1e3 * p.get('worker_decode_s', 0):.1f} |")
        if a.json is not None:
            a.json.write_text(json.dumps({"meta": _meta(), "plan_only": plans}, indent=1))
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(threadName)s %(name)s: %(message)s")
    old = json.loads(a.json.read_text())["rows"] if a.json is not None and a.append and a.json.exists() else []
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ckptless-cp-") as tmp:
        for w in a.worlds:
            rows.append(run_world(w, a.ranks_per_node, a.procs, a.agent_procs, a.worker_nice, a.lease_ttl, a.victim,
                                  a.budget_s, a.etcd_dir or None, a.grpc_wait_slice or None, etcd_cpu, not a.no_relay,
                                  a.work or Path(tmp),
                                  lambda s: print(s, flush=True)))
            if a.json is not None:  # after every W: a later one may not finish
                mine = {r["world"] for r in rows}
                keep = sorted([r for r in old if r["world"] not in mine] + rows, key=lambda r: r["world"])
                a.json.write_text(json.dumps({"meta": _meta(), "rows": keep}, indent=1))
    if a.json is not None:
        rows = json.loads(a.json.read_text())["rows"]
    print()
    print(table(rows))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
