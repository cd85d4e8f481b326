"""The emulated job's shape and the records it writes, for bench/control_plane.py (pure: no etcd).

Everything here builds the product's own records with the product's own types and
encoders: the generation-0 membership as the rendezvous publishes it
(``launcher/joining.py``: node-major ranks, worker ids ``<node>/w<local rank>``, source
"survivor"), the closed rendezvous round, a survivor's ``WorkerReport`` as
``recovery/executor.py build_report`` makes it (its own image at the committed
version, the images it holds under K = 1 ring placement, two versions each), and the
exit record an agent writes for a SIGKILLed worker (``launcher/exit_records.py``).
It also reads etcd's counters and a process's CPU time, which the driver samples.
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptless.coordinator.rendezvous import NodeInfo, RoundState
from ckptless.mirror.placement import compute_placement
from ckptless.recovery.decision import Assignment
from ckptless.recovery.facts import ReplicaFact, WorkerReport
from ckptless.recovery.view import ExitRecord
from ckptless.recovery.wire import Membership

HOST = "127.0.0.1"
#: The version every survivor committed (any step count; the plan resumes here).
COMMITTED = 1000
#: Chunks of one rank's image (256 MiB of state in 4 MiB chunks).
N_CHUNKS = 64
#: A layout key (``ckptless/state/layout.py``: 32 hex digits); identical ranks share one.
LAYOUT_KEY = "5f0c2a9e1b7d4c3a8e6f0b2d9c1a7e4f"
#: Why a survivor left generation 0 (``ckptless/worker/training.py``).
REASON = "the coordinator declared generation 0 failed"


@dataclass(frozen=True)
class Layout:
    """W ranks on N nodes, L per node (the last node holds the remainder when L does not divide W)."""

    world: int
    per_node: int
    job_id: str

    @property
    def n_nodes(self) -> int:
        return -(-self.world // self.per_node)

    def node_id(self, node: int) -> str:
        return f"bench-node{node:05d}"

    def ranks_of(self, node: int) -> range:
        return range(node * self.per_node, min(self.world, (node + 1) * self.per_node))

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def worker_id(self, rank: int) -> str:
        return f"{self.node_id(self.node_of(rank))}/w{rank % self.per_node}"

    def membership(self, store_port: int) -> Membership:
        """Generation 0, as ``launcher/joining.py`` builds it from the closed round."""
        ranks = tuple(Assignment(r, self.worker_id(r), self.node_id(self.node_of(r)), "survivor")
                      for r in range(self.world))
        return Membership(0, self.world, HOST, store_port, ranks, None)

    def round_state(self) -> RoundState:
        nodes = tuple(NodeInfo(self.node_id(n), HOST, len(self.ranks_of(n)), 0) for n in range(self.n_nodes))
        return RoundState(0, "closed", nodes, self.n_nodes, self.n_nodes)

    def held(self) -> list[list[int]]:
        """For each rank, the owners whose image it holds (K = 1, ring placement, node-aware)."""
        node_of = [self.node_id(self.node_of(r)) for r in range(self.world)]
        pl = compute_placement(self.world, 1, "ring", node_of)
        return [list(pl.owners_held_by(r)) for r in range(self.world)]


def survivor_report(worker_id: str, owners: list[int]) -> WorkerReport:
    """What a survivor of generation 0 reports: its own image at the committed version and the two
    newest complete versions of each owner it mirrors (the peer store double-buffers)."""
    replicas = tuple(ReplicaFact(o, v, N_CHUNKS, LAYOUT_KEY) for o in sorted(owners) for v in (COMMITTED - 1, COMMITTED))
    return WorkerReport(worker_id, COMMITTED, COMMITTED, frozenset({COMMITTED}), replicas, ((COMMITTED, LAYOUT_KEY),))


def sigkill_record(rank: int, worker_id: str, node_id: str, pid: int, wall: float) -> bytes:
    """The record an agent puts for a worker it reaped after a SIGKILL (no exit file, no shm dir)."""
    return ExitRecord(rank=rank, worker_id=worker_id, node_id=node_id, pid=pid, exitcode=None, signal=9,
                      time=wall, requested=False, kind=None, error=None, respawnable=True).to_json()


def write_held(path: Path, held: list[list[int]]) -> None:
    path.write_text(json.dumps(held))


def read_held(path: Path) -> list[list[int]]:
    return [list(map(int, x)) for x in json.loads(path.read_text())]


# --- what the driver samples ---------------------------------------------------------------------
COUNTERS = {
    "events": "etcd_debugging_mvcc_events_total",  # watch events etcd sent (bench/scale.py)
    "bytes": "etcd_network_client_grpc_sent_bytes_total",  # gRPC bytes etcd sent
    "puts": "etcd_mvcc_put_total",
    "ranges": "etcd_mvcc_range_total",
    "txns": "etcd_mvcc_txn_total",
}


def etcd_counters(endpoint: str, timeout_s: float = 10.0) -> dict[str, float]:
    """etcd's Prometheus counters (the same two bench/scale.py reads, plus the request counts)."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=timeout_s) as r:
        text = r.read().decode()
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        for name, metric in COUNTERS.items():
            if line.startswith(metric) and (len(line) == len(metric) or line[len(metric)] in " {"):
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (all its threads) so far; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def threads_in_use() -> int:
    """Tasks (threads) on the whole machine now: the 4th field of /proc/loadavg."""
    with open("/proc/loadavg") as f:
        return int(f.read().split()[3].split("/")[1])


def thread_limit() -> int:
    """The most tasks the kernel allows at once (pid_max and threads-max, the smaller)."""
    values = []
    for p in ("/proc/sys/kernel/pid_max", "/proc/sys/kernel/threads-max"):
        try:
            values.append(int(Path(p).read_text()))
        except (OSError, ValueError):
            pass
    return min(values) if values else 1 << 22


class Probe:
    """How long etcd takes to answer a trivial read, five times a second (a measurement, not a
    synchronisation): shows when etcd itself stalls, e.g. starved of CPU by the emulation."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.samples: list[tuple[float, float]] = []  # (start, seconds to answer)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bench-probe", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.2):
            t = time.monotonic()
            try:
                self.client.revision(timeout_s=30.0)
            except Exception:  # noqa: BLE001 - a failed probe is a 30 s answer
                pass
            self.samples.append((t, time.monotonic() - t))

    def worst(self, t0: float, t1: float) -> float | None:
        inside = [d for t, d in self.samples if t0 <= t <= t1]
        return max(inside) if inside else None

    def slow(self, origin: float, over_s: float = 0.5) -> list[tuple[float, float]]:
        """(start - origin, seconds) of every answer slower than ``over_s``."""
        return [(round(t - origin, 2), round(d, 2)) for t, d in self.samples if d > over_s]

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=35.0)


def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` (threads it starts later inherit it) on ``cpus``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:
            pass  # a thread that just ended


class Lateness:
    """How late a thread of this process wakes from a 50 ms sleep (a measurement): how long this
    process waited for a CPU (or its GIL) at worst, and when."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []  # (time, seconds late)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bench-lateness", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            t = time.monotonic()
            time.sleep(0.05)  # the measurement itself: how late this returns
            late = time.monotonic() - t - 0.05
            if late > 0.1:
                self.samples.append((t, late))

    def worst(self, t0: float = 0.0, t1: float = float("inf")) -> float:
        return max((d for t, d in self.samples if t0 <= t <= t1), default=0.0)
