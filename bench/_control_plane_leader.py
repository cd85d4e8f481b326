"""The coordinator leader of bench/control_plane.py, and the timing of its planning step.

The leader is the product's ``RecoveryLeader`` built as ``launcher/agent.py _start_leader`` builds it
(the same ``LeaderConfig`` from ``ckptless-run``'s defaults: K = 1, ring placement, node grace,
collective timeout + 10 s for a live rank's report), with its own etcd client and lease session,
campaigning in the real election. What the benchmark takes from it: the times of its
``on_event`` hook (``incident_opened``, ``plan_published``; the agent passes the goodput ledger's sink
there) and of its log lines (``every rank resumed``), caught by a logging handler.

``time_planning`` re-runs the leader's planning step on the same facts after the run: the keys
``read_view`` reads (with generation 0's membership), ``parse_records``, then ``plan_from_view`` (what
the leader calls inside its RequestPlan action), one ``step`` of the leader machine on that view
(what every re-read of the view costs while reports come in) and the ring placement alone.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

from _control_plane_layout import HOST, REASON, Layout, sigkill_record, survivor_report

from ckptless import environment
from ckptless.coordinator.client import EtcdClient
from ckptless.coordinator.config import EtcdConfig
from ckptless.coordinator.keyspace import Keyspace
from ckptless.coordinator.session import Session
from ckptless.launcher.args import LaunchConfig
from ckptless.mirror.placement import compute_placement
from ckptless.recovery.decision import RecoveryPlan
from ckptless.recovery.gather import plan_from_view
from ckptless.recovery.leader import RecoveryLeader
from ckptless.recovery.leader_machine import Collecting, LeaderConfig, Observed, step
from ckptless.recovery.view import parse_records, report_record_to_json
from ckptless.recovery.wire import Membership, membership_from_json, membership_to_json


def leader_config(job_id: str) -> LeaderConfig:
    """``launcher/agent.py _start_leader``'s config with ``ckptless-run``'s default flags."""
    defaults: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(LaunchConfig)}
    collective = environment.current().collective_timeout_s or 60.0
    return LeaderConfig(job_id, int(defaults["replicas"]), str(defaults["placement"]),
                        node_grace_s=float(defaults["node_grace"]), alive_report_timeout_s=collective + 10.0)


def default_lease_ttl() -> float:
    defaults: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(LaunchConfig)}
    return float(defaults["lease_ttl"])


class _Catch(logging.Handler):
    def __init__(self, harness: LeaderHarness) -> None:
        super().__init__(logging.INFO)
        self.harness = harness

    def emit(self, record: logging.LogRecord) -> None:
        self.harness.logged(time.monotonic(), record.levelname, record.getMessage())


class LeaderHarness:
    """One ``RecoveryLeader`` with its own client and lease, and what it said when."""

    def __init__(self, endpoint: str, ks: Keyspace, lease_ttl: float, store_port: int) -> None:
        self.config = leader_config(ks.job_id)
        self.cond = threading.Condition()
        self.events: dict[str, tuple[float, dict[str, object]]] = {}
        self.lines: list[tuple[float, str, str]] = []
        self.client = EtcdClient(EtcdConfig((endpoint,)))
        self.session = Session(self.client, ttl_s=lease_ttl, name="bench-leader")
        self.logger = logging.getLogger("ckptless.recovery.leader")
        self.handler = _Catch(self)
        self.logger.addHandler(self.handler)
        self.logger.setLevel(logging.INFO)
        self.leader = RecoveryLeader(self.client, ks, self.session, HOST, store_port, self.config,
                                     on_event=self._on_event)

    def _on_event(self, kind: str, attrs: dict[str, object]) -> None:
        with self.cond:
            self.events.setdefault(kind, (time.monotonic(), dict(attrs)))
            self.cond.notify_all()

    def logged(self, t: float, level: str, message: str) -> None:
        with self.cond:
            self.lines.append((t, level, message))
            self.cond.notify_all()

    def start(self, deadline: float) -> None:
        self.leader.start()
        if not self.leader.is_leader.wait(max(0.0, deadline - time.monotonic())):
            raise TimeoutError("the leader was not elected in time")

    def wait_event(self, kind: str, deadline: float) -> tuple[float, dict[str, object]]:
        with self.cond:
            if not self.cond.wait_for(lambda: kind in self.events, timeout=max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"the leader's {kind!r} did not come in time; its log: {self.tail()}")
            return self.events[kind]

    def wait_line(self, text: str, deadline: float) -> float:
        def found() -> float | None:
            return next((t for t, _, m in self.lines if text in m), None)

        with self.cond:
            if not self.cond.wait_for(lambda: found() is not None, timeout=max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"the leader did not log {text!r} in time; its log: {self.tail()}")
            t = found()
            assert t is not None
            return t

    def tail(self, n: int = 8) -> list[str]:
        with self.cond:
            return [f"t={t:.3f} {lvl}: {m[:300]}" for t, lvl, m in self.lines[-n:]]

    def warnings(self) -> list[str]:
        with self.cond:
            return [m[:300] for _, lvl, m in self.lines if lvl in ("WARNING", "ERROR")]

    def close(self) -> None:
        self.leader.stop()
        self.logger.removeHandler(self.handler)
        try:
            self.session.close()
        finally:
            self.client.close()


def published(client: EtcdClient, ks: Keyspace) -> Membership:
    kv = client.get(ks.membership)
    if kv is None:
        raise RuntimeError("no membership in etcd")
    return membership_from_json(kv.value)


def describe_plan(m: Membership) -> dict[str, Any]:
    d = m.decision
    out: dict[str, Any] = {"generation": m.generation, "plan": type(d).__name__}
    if isinstance(d, RecoveryPlan):
        out.update(lost=list(d.lost_ranks), resume_version=d.resume_version, transfers=len(d.transfers),
                   replaced=[[a.rank, a.source] for a in d.assignments if a.source != "survivor"])
    return out


def time_planning(client: EtcdClient, ks: Keyspace, layout: Layout, m0: Membership, lost: frozenset[int],
                  cfg: LeaderConfig) -> dict[str, Any]:
    """The leader's planning step again, on the facts it planned from (see the module docstring)."""
    t0 = time.perf_counter()
    exits, _ = client.get_prefix(ks.exits_prefix)
    nodes, _ = client.get_prefix(ks.nodes_prefix)
    spares, _ = client.get_prefix(ks.spares_prefix)
    status = client.get(ks.status)
    reports = [(r.key, r.value) for r in client.get_prefix(ks.facts_prefix(0))[0]]
    ready = [r.key for r in client.get_prefix(ks.ready_prefix(0))[0]]
    incident = client.get(ks.incident(0)) is not None
    ported = client.get(ks.ported) is not None
    read_s = time.perf_counter() - t0
    out = plan_timings(layout, membership_to_json(m0), [(e.key, e.value) for e in exits],
                       [n.key.rsplit("/", 1)[1] for n in nodes], reports, ready, [(s.key, s.value) for s in spares],
                       None if status is None else status.value, incident, ported, lost, cfg)
    return {"view_read_s": read_s, **out}


def plan_timings(layout: Layout, membership: bytes, exits: list[tuple[str, bytes]], nodes: list[str],
                 reports: list[tuple[str, bytes]], ready: list[str], spares: list[tuple[str, bytes]],
                 status: bytes | None, incident: bool, ported: bool, lost: frozenset[int],
                 cfg: LeaderConfig) -> dict[str, Any]:
    """Decode and plan as the leader does, from the raw records ``read_view`` reads (no etcd)."""
    t1 = time.perf_counter()
    m = membership_from_json(membership)
    view = parse_records(m, exits, nodes, reports, ready, spares, status, incident, ported)
    t2 = time.perf_counter()
    decision, _ = plan_from_view(view, layout.job_id, lost, cfg.replicas, cfg.placement, None)
    t3 = time.perf_counter()
    step(Collecting(0, lost, 0.0, 1e9), Observed(view, 1.0), cfg)
    t4 = time.perf_counter()
    compute_placement(layout.world, cfg.replicas, cfg.placement, [a.node_id for a in m.ranks])
    t5 = time.perf_counter()
    out: dict[str, Any] = {"view_parse_s": t2 - t1, "plan_compute_s": t3 - t2, "observe_s": t4 - t3,
                           "placement_s": t5 - t4, "facts_kib": sum(len(v) for _, v in reports) / 1024,
                           "decision": type(decision).__name__}
    if isinstance(decision, RecoveryPlan):  # what each worker then does with the published record
        raw = membership_to_json(Membership(decision.generation, m.world_size, m.store_host, m.store_port,
                                            decision.assignments, decision))
        t6 = time.perf_counter()
        membership_from_json(raw).rank_of(layout.worker_id(0))
        out.update(worker_decode_s=time.perf_counter() - t6, membership1_kib=len(raw) / 1024)
    return out


def offline_planning(layout: Layout, victim: int) -> dict[str, Any]:
    """The leader's planning cost at ``layout.world`` ranks without etcd or emulated workers: the same
    records the emulation writes (the exit record, every node key, W - 1 survivor reports as
    ``WorkerControl.report`` encodes them), decoded and planned as in :func:`time_planning`."""
    ks = Keyspace(layout.job_id)
    held = layout.held()
    reports = [(ks.facts(0, r), report_record_to_json(survivor_report(layout.worker_id(r), held[r]), REASON))
               for r in range(layout.world) if r != victim]
    node = layout.node_id(layout.node_of(victim))
    exits = [(ks.worker_exit(victim), sigkill_record(victim, layout.worker_id(victim), node, 1, time.time()))]
    nodes = [layout.node_id(n) for n in range(layout.n_nodes)]
    out = plan_timings(layout, membership_to_json(layout.membership(1)), exits, nodes, reports, [], [], None,
                       True, True, frozenset({victim}), leader_config(layout.job_id))
    return {"world": layout.world, "agents": layout.n_nodes, "offline": True, **out}
