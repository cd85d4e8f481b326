"""One emulation process of bench/control_plane.py: the agents, or the workers, of a slice of the job's nodes.

Run by the driver, never by hand: ``_control_plane_node.py --role agents|workers --endpoint E --job J
--world W --per-node L --nodes A B --held FILE --victim R --lease-ttl T --deadline-s S``. Agents and
workers live in different processes, as on a real node (an agent's lease keepalive must not queue for
the GIL behind hundreds of worker threads). It talks to the driver in JSON lines: ``up`` once its
agents registered or its workers joined generation 0; on ``die`` (the victim's worker process) the
victim's client is closed and it says ``died``; on ``reap`` (the victim's agent process) the agent
writes the exit record and says ``killed`` with the time; ``notified`` once each of its workers'
``wait_membership`` returned (an agent process: its replacement's); on ``ready`` each marks itself
ready and it says ``marked``; it leaves on ``exit`` or EOF.

What is real here (the product's classes, unchanged):

* an agent per node: its own ``EtcdClient``, a lease ``Session`` (keepalive thread, TTL as
  ``--lease-ttl``), its node key through ``Rendezvous.register``, the exit record through the agent's
  ``Outbox``, and the membership follower's watch on ``job/`` that decodes each membership
  (``launcher/follower.py``); a respawn it is assigned starts a new worker under the planned id;
* a worker per rank: ``ckptless.worker.control.WorkerControl``, subscribed to its node's relay (it
  learns from the agent's watch and writes through the agent: no etcd connection of its own), or with
  its own etcd client and watch under ``--no-relay``.
  ``Worker`` below adds one flag to it, raised by the watch callback after the product's own handling
  when the incident of its generation arrived: it stands for the training thread's per-step
  ``incident()`` check (``worker/training.py``), without the step. The worker's own thread then does
  what a real survivor does: ``report`` (a ``WorkerReport`` of what it holds), ``wait_membership``,
  and ``mark_ready`` once the driver says so.

Not emulated: the training step, groups, transfers and restores (no torch work), the contenders'
election keys (one leader only, in the driver), the TCPStore.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _control_plane_layout import (  # noqa: E402
    HOST,
    REASON,
    Lateness,
    Layout,
    read_held,
    sigkill_record,
    survivor_report,
)

from ckptless.coordinator.client import EtcdClient, WatchEvent  # noqa: E402
from ckptless.coordinator.config import EtcdConfig  # noqa: E402
from ckptless.coordinator.keyspace import Keyspace  # noqa: E402
from ckptless.coordinator.rendezvous import NodeInfo, Rendezvous  # noqa: E402
from ckptless.coordinator.session import Session  # noqa: E402
from ckptless.launcher.outbox import Outbox  # noqa: E402
from ckptless.recovery.facts import WorkerReport  # noqa: E402
from ckptless.recovery.wire import Membership, membership_from_json  # noqa: E402
from ckptless.coordinator.relay_server import RelayServer  # noqa: E402
from ckptless.coordinator.relay_writer import RelayWriter  # noqa: E402
from ckptless.worker.control import WorkerControl  # noqa: E402

_out = threading.Lock()


def emit(doc: dict[str, Any]) -> None:
    with _out:
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()


def own_connections() -> None:
    """One TCP connection per etcd client, as a worker (a process of its own) has. gRPC otherwise
    shares one connection among every channel of a process to the same target (its global
    subchannel pool), which would make the emulated workers cheaper for etcd than real ones."""
    import grpc

    plain = grpc.insecure_channel

    def channel(target: str, options: Any = None, compression: Any = None) -> Any:
        opts = list(options or []) + [("grpc.use_local_subchannel_pool", 1)]
        return plain(target, options=opts, compression=compression)

    grpc.insecure_channel = channel


def grpc_wait_slice(seconds: float) -> None:
    """How often gRPC Python wakes a thread blocked on a call to let signal handlers run
    (``grpc/_common.py`` MAXIMUM_WAIT_TIMEOUT, 0.1 s): every watch's reader thread wakes that often.
    Ten wakeups a second cost a real worker nothing; thousands of clients on 2 cores, most of it."""
    import grpc._common

    grpc._common.MAXIMUM_WAIT_TIMEOUT = seconds


class Worker(WorkerControl):
    """The product's worker control handle, plus a flag for the worker's own thread (see the module doc)."""

    def __init__(self, endpoint: str, job_id: str, worker_id: str, rank: int, generation: int,
                 relay_path: str | None) -> None:
        self.rank = rank
        self.generation = generation
        self.incident_seen = threading.Event()
        self.times: dict[str, float] = {}
        super().__init__(endpoint, job_id, worker_id, relay_path=relay_path)

    def _on_events(self, events: list[WatchEvent]) -> None:
        super()._on_events(events)
        if self.incident(self.generation) and not self.incident_seen.is_set():
            self.times["seen"] = time.monotonic()
            self.incident_seen.set()


class Agent:
    """A node agent's etcd side: client, lease, node key, outbox, and the membership follower's watch."""

    def __init__(self, node: "Node", node_id: str, nproc: int) -> None:
        self.node, self.node_id = node, node_id
        self.client = EtcdClient(EtcdConfig.from_env(node.endpoint))
        self.session = Session(self.client, ttl_s=node.lease_ttl, name=node_id)
        Rendezvous(self.client, node.ks, self.session).register(NodeInfo(node_id, HOST, nproc, 0))
        self.stopping = threading.Event()
        self.outbox = Outbox(lambda: self.client, self.stopping)
        self.generation = 0
        # The node's control relay, fed as launcher/agent.py feeds it (its workers subscribe to it and
        # write through it: their puts go out in batches, one transaction each).
        self.relay = (RelayServer(node.relay_dir_of(node_id), writer=RelayWriter(lambda: self.client, node.ks.worker_writes))
                      if node.relay_dir else None)
        self.watch = self.client.watch_prefix(node.ks.job_prefix, self._on_events)
        if self.relay is not None:
            self.relay.seed(self.client.get_prefix(node.ks.job_prefix)[0])

    def _on_events(self, events: list[WatchEvent]) -> None:
        if self.relay is not None:
            self.relay.on_events(events)
        for ev in events:  # launcher/follower.py on_events: a membership is decoded and followed
            if ev.key == self.node.ks.membership and ev.kind == "put":
                m = membership_from_json(ev.value)
                if m.generation > self.generation:
                    self.generation = m.generation
                    respawns = [a for a in m.ranks if a.node_id == self.node_id and a.source == "respawn"]
                    for a in respawns:
                        threading.Thread(target=self.node.respawn, args=(a.rank, a.worker_id, m.generation),
                                         name="bench-respawn", daemon=True).start()

    def close(self) -> None:
        self.stopping.set()
        self.watch.cancel()
        if self.relay is not None:
            self.relay.close()
        self.session.close()
        self.client.close()


class Node:
    """The emulation process: the agents or the workers of its nodes, the driver's commands, the timings."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.endpoint, self.lease_ttl = a.endpoint, a.lease_ttl
        self.relay_dir: str | None = a.relay_dir
        self.layout = Layout(a.world, a.per_node, a.job)
        self.ks = Keyspace(a.job)
        self.deadline = time.monotonic() + a.deadline_s
        self.victim = a.victim
        self.nodes = range(a.nodes[0], a.nodes[1])
        self.agents: dict[int, Agent] = {}
        self.workers: dict[int, Worker] = {}
        self.replacements: list[Worker] = []
        self.ready_go = threading.Event()
        self.cond = threading.Condition()
        self.notified = 0
        self.marked = 0
        self.expected = 0  # workers here whose wait_membership must return (survivors or replacements)
        self.base = self.usage()  # before any client: the interpreter, torch (imported by worker.control)
        self.lateness = Lateness()

    def relay_dir_of(self, node_id: str) -> str:
        assert self.relay_dir is not None
        return os.path.join(self.relay_dir, node_id.replace("/", "_"))

    def relay_of(self, worker_id: str) -> str | None:
        """The relay socket of the worker's node (None: the worker watches etcd itself)."""
        return os.path.join(self.relay_dir_of(worker_id.split("/")[0]), "s") if self.relay_dir else None

    # --- set-up ----------------------------------------------------------------------------------
    def start_agents(self) -> None:
        for n in self.nodes:
            self.agents[n] = Agent(self, self.layout.node_id(n), len(self.layout.ranks_of(n)))
        if self.layout.node_of(self.victim) in self.agents:
            self.expected = 1  # the replacement its agent will start
        emit({"msg": "up", "role": "agents", "n": len(self.agents), "base": self.base, **self.usage()})

    def start_workers(self, held: list[list[int]]) -> None:
        reports: dict[int, WorkerReport] = {}
        for n in self.nodes:
            for r in self.layout.ranks_of(n):
                wid = self.layout.worker_id(r)
                w = self.workers[r] = Worker(self.endpoint, self.ks.job_id, wid, r, 0, self.relay_of(wid))
                w.mark_ported()  # ckptless.init() does it in every worker
                # then it joins: its first wait_membership takes (and decodes) generation 0
                if w.wait_membership(-1, self.deadline) is None:
                    raise TimeoutError(f"rank {r} did not see generation 0")
                reports[r] = survivor_report(w.worker_id, held[r])
        for r, w in self.workers.items():
            if r != self.victim:
                self.expected += 1
                threading.Thread(target=self.survivor, args=(w, reports[r]), name=f"bench-w{r}", daemon=True).start()
        emit({"msg": "up", "role": "workers", "n": len(self.workers), "base": self.base, **self.usage()})

    def usage(self) -> dict[str, Any]:
        status = Path("/proc/self/status").read_text().splitlines()
        get = {ln.split(":")[0]: ln.split(":")[1].strip() for ln in status if ":" in ln}
        sockets = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                sockets += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
            except OSError:
                pass
        return {"rss_kib": int(get["VmRSS"].split()[0]), "threads": int(get["Threads"]), "sockets": sockets}

    # --- the incident ----------------------------------------------------------------------------
    def survivor(self, w: Worker, report: WorkerReport) -> None:
        """A survivor of generation 0: report when the incident arrives, wait for the next membership."""
        if not w.incident_seen.wait(max(0.0, self.deadline - time.monotonic())):
            return
        w.report(0, w.rank, report, REASON)
        w.times["reported"] = time.monotonic()
        self.await_membership(w, after=0)

    def respawn(self, rank: int, worker_id: str, generation: int) -> None:
        """The agent starts the rank again under the planned id; the new worker joins from its watch."""
        t0 = time.monotonic()
        w = Worker(self.endpoint, self.ks.job_id, worker_id, rank, generation, self.relay_of(worker_id))
        w.times["started"] = t0
        with self.cond:
            self.replacements.append(w)
        self.await_membership(w, after=-1)

    def await_membership(self, w: Worker, after: int) -> None:
        m = w.wait_membership(after, self.deadline)
        w.times["notified"] = time.monotonic()
        w.times["generation"] = -1 if m is None else m.generation
        with self.cond:
            self.notified += 1
            self.cond.notify_all()
        if m is None or m.rank_of(w.worker_id) is None:
            return
        if self.ready_go.wait(max(0.0, self.deadline - time.monotonic())):
            w.mark_ready(m.generation, w.rank)  # it restored and resumed in the new generation
            with self.cond:
                self.marked += 1
                self.cond.notify_all()

    def die(self) -> None:
        """The victim's process dies: its etcd connection and watch go with it."""
        self.workers[self.victim].close()
        emit({"msg": "died", "t": time.monotonic()})

    def reap(self) -> None:
        """Its agent reaps it and records the exit (``launcher/exit_records.py``, through the outbox)."""
        agent = self.agents[self.layout.node_of(self.victim)]
        t = time.monotonic()
        agent.outbox.put(self.ks.worker_exit(self.victim),
                         sigkill_record(self.victim, self.layout.worker_id(self.victim), agent.node_id,
                                        4_000_000 + self.victim, time.time()),
                         f"the exit of rank {self.victim}")
        emit({"msg": "killed", "t": t})

    def wait_count(self, what: str, msg: str) -> None:
        with self.cond:
            ok = self.cond.wait_for(lambda: getattr(self, what) >= self.expected,
                                    timeout=max(0.0, self.deadline - time.monotonic()))
        everyone = [w for r, w in self.workers.items() if r != self.victim] + self.replacements
        times = [{"rank": w.rank, "id": w.worker_id, "events": w.events_seen, **w.times} for w in everyone]
        emit({"msg": msg, "ok": ok, "count": getattr(self, what), "expected": self.expected,
              "workers": times if msg == "notified" else [], "late": self.lateness.samples[-50:], **self.usage()})

    def close(self) -> None:
        for a in self.agents.values():
            a.close()
        everyone = [w for r, w in self.workers.items() if r != self.victim] + self.replacements
        for w in everyone:
            w.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=("agents", "workers"), required=True)
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--per-node", type=int, required=True)
    ap.add_argument("--nodes", type=int, nargs=2, required=True)
    ap.add_argument("--held", type=Path, required=True)
    ap.add_argument("--victim", type=int, required=True)
    ap.add_argument("--lease-ttl", type=float, default=2.0)
    ap.add_argument("--deadline-s", type=float, default=540.0)
    ap.add_argument("--shared-connections", action="store_true")
    ap.add_argument("--relay-dir", default=None, help="the nodes' control relays live here (default: none, "
                                                      "every worker watches etcd itself)")
    ap.add_argument("--nice", type=int, default=0)
    ap.add_argument("--grpc-wait-slice", type=float, default=None)
    ap.add_argument("--idle", action="store_true", help="SCHED_IDLE: run only when nothing else wants a CPU")
    a = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(threadName)s %(name)s: %(message)s")
    if not a.shared_connections:
        own_connections()
    if a.grpc_wait_slice is not None:
        grpc_wait_slice(a.grpc_wait_slice)
    if a.idle:  # before any thread starts: every thread of this process inherits the policy
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    elif a.nice:
        os.nice(a.nice)
    node = Node(a)
    if a.role == "agents":
        node.start_agents()
    else:
        node.start_workers(read_held(a.held))
    threading.Thread(target=node.wait_count, args=("notified", "notified"), daemon=True).start()
    for line in sys.stdin:  # the driver's commands; EOF (the driver is gone) ends the process
        cmd = line.strip()
        if cmd == "die":
            node.die()
        elif cmd == "reap":
            node.reap()
        elif cmd == "ready":
            node.ready_go.set()
            threading.Thread(target=node.wait_count, args=("marked", "marked"), daemon=True).start()
        elif cmd == "exit":
            break
    closer = threading.Thread(target=node.close, daemon=True)
    closer.start()
    closer.join(timeout=20.0)  # polite goodbyes to etcd, bounded; the process ends either way
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
