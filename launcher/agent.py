"""The node agent behind ``ckptless-run``: one per node, long-lived.

Why a separate long-lived agent (as in torchelastic): the agent survives its
workers, so it can report their exits to etcd within milliseconds, host a
TCPStore (a store hosted by a worker dies with it), detect hung workers, run
the coordinator leader, keep warm spares, and respawn failed workers. It never
imports training code.

Lifecycle: connect to etcd (embedded when no endpoint) -> lease session ->
host a TCPStore -> rendezvous (node rank) -> initial membership -> leader
campaign -> spawn workers (+ spares) -> record exits, follow memberships
(respawn / kill / adopt a spare) -> wait until every rank of the newest
generation finished (or the job failed) -> revoke the lease -> stop etcd.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass
from types import FrameType

from ckptless.coordinator.client import EtcdClient, WatchEvent
from ckptless.coordinator.config import EtcdConfig
from ckptless.coordinator.embedded import EmbeddedEtcd
from ckptless.coordinator.keyspace import Keyspace
from ckptless.coordinator.rendezvous import NodeInfo, Rendezvous, RendezvousResult
from ckptless.coordinator.session import Session
from ckptless.errors import CkptlessError, CoordinatorError, RendezvousTimeout
from ckptless.launcher.args import LaunchConfig, Std
from ckptless.launcher.slots import Slot, SlotTable
from ckptless.launcher.worker_env import WorkerLayout, build_command, worker_env
from ckptless.launcher.workers import WorkerExit, WorkerGroup
from ckptless.recovery.facts import Worker
from ckptless.recovery.leader import RecoveryLeader, write_initial_membership
from ckptless.recovery.leader_machine import LeaderConfig
from ckptless.recovery.plan import Assignment
from ckptless.recovery.wire import Membership, membership_from_json, spare_to_json

log = logging.getLogger("ckptless.agent")


@dataclass(frozen=True)
class AgentOutcome:
    exit_code: int
    failed_ranks: tuple[int, ...]


class NodeAgent:
    def __init__(self, cfg: LaunchConfig, etcd_config: EtcdConfig | None = None, rendezvous_timeout_s: float = 900.0) -> None:
        self.cfg = cfg
        self._etcd_config = etcd_config
        self.rendezvous_timeout_s = float(cfg.rdzv_configs.get("join_timeout", rendezvous_timeout_s))
        self.keyspace = Keyspace(cfg.run_id)
        self.node_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.recovery = cfg.replicas > 0
        self._wake = threading.Event()
        self._failed = threading.Event()
        self._stop_signal: int | None = None
        self._client: EtcdClient | None = None
        self._result: RendezvousResult | None = None
        self._group: WorkerGroup | None = None
        self.slots = SlotTable()
        self._membership: Membership | None = None
        self._membership_lock = threading.Lock()
        self._hb_dir = tempfile.mkdtemp(prefix="ckptless-hb-")

    # --- signals ---------------------------------------------------------------------
    def _install_signal_handlers(self) -> None:
        def handler(signum: int, _frame: FrameType | None) -> None:
            self._stop_signal = signum
            if self._group is not None:
                self._group.signal_all(signum)
            self._failed.set()
            self._wake.set()

        if threading.current_thread() is threading.main_thread():
            for name in self.cfg.signals_to_handle:
                sig = getattr(signal, name, None)
                if isinstance(sig, signal.Signals):
                    signal.signal(sig, handler)

    # --- exit records ---------------------------------------------------------------------
    def _record_exit(self, ex: WorkerExit) -> None:
        """Called by the reaper the moment a worker is reaped: into etcd first, then decide."""
        assert self._client is not None
        slot = self.slots.get(ex.local_rank)
        doc = {
            "rank": slot.rank if slot.rank is not None else -1,
            "local_rank": ex.local_rank,
            "worker_id": slot.worker_id,
            "node_id": self.node_id,
            "pid": ex.pid,
            "exitcode": ex.exitcode,
            "signal": ex.signal,
            "time": ex.wall,
            "requested": ex.requested,
        }
        if slot.rank is not None:
            try:
                self._client.put(self.keyspace.worker_exit(slot.rank), json.dumps(doc))
            except CoordinatorError:
                log.exception("could not record the exit of rank %s", slot.rank)
        self.slots.exited(ex.local_rank, ex.succeeded)
        if not ex.succeeded and not ex.requested:
            log.error("worker %s (rank %s, pid %d) failed: exitcode=%s signal=%s",
                      slot.worker_id, slot.rank, ex.pid, ex.exitcode, ex.signal)
            if not self.recovery:
                self._failed.set()
        self._wake.set()

    def _on_events(self, events: list[WatchEvent]) -> None:
        for ev in events:
            if ev.key == self.keyspace.membership and ev.kind == "put":
                self._apply_membership(membership_from_json(ev.value))
            elif ev.key == self.keyspace.status and ev.kind == "put":
                if json.loads(ev.value).get("state") == "failed":
                    self._failed.set()
            elif not self.recovery and ev.key.startswith(self.keyspace.exits_prefix) and ev.kind == "put":
                doc = json.loads(ev.value)
                if doc.get("node_id") != self.node_id and (doc.get("exitcode") not in (0, None) or doc.get("signal")):
                    log.error("rank %s on another node failed; stopping this node's workers", doc.get("rank"))
                    self._failed.set()
        self._wake.set()

    # --- memberships ---------------------------------------------------------------------------
    def _apply_membership(self, m: Membership) -> None:
        """Follow a new generation: adopt assigned spares, respawn here, kill the dropped."""
        with self._membership_lock:
            if self._membership is not None and m.generation <= self._membership.generation:
                return
            self._membership = m
            group = self._group
            if group is None:
                return
            by_worker = {a.worker_id: a for a in m.ranks}
            for slot in self.slots.all():
                a = by_worker.get(slot.worker_id)
                if a is not None:
                    self.slots.assign(slot.local_rank, a.rank)
                elif slot.rank is not None:
                    if slot.alive:
                        log.warning("worker %s is not part of generation %d: killing it", slot.worker_id, m.generation)
                        group.send_signal(slot.local_rank, signal.SIGKILL)
                    self.slots.assign(slot.local_rank, None)  # its rank now runs elsewhere
            for a in m.ranks:
                if a.node_id == self.node_id and a.source == "respawn":
                    self._respawn(group, a, m.generation)

    def _respawn(self, group: WorkerGroup, a: Assignment, generation: int) -> None:
        slot = self.slots.for_rank_slot(a.rank, self._result.rank_offset if self._result else 0)
        if slot is None or slot.worker_id == a.worker_id:
            return
        log.warning("respawning rank %d as %s (generation %d)", a.rank, a.worker_id, generation)
        self.slots.reset(slot.local_rank, a.worker_id, a.rank)
        try:  # the new incarnation must not be judged by its predecessor's heartbeat
            os.unlink(slot.heartbeat_file)
        except FileNotFoundError:
            pass
        try:
            group.respawn(slot.local_rank, {
                "CKPTLESS_WORKER_ID": a.worker_id, "CKPTLESS_ROLE": "replacement",
                "CKPTLESS_GENERATION": str(generation), "RANK": str(a.rank),
            })
        except CkptlessError:
            log.exception("respawn of rank %d failed", a.rank)

    # --- hang detection ----------------------------------------------------------------------------
    def _watch_hangs(self) -> None:
        timeout = self.cfg.hang_timeout
        if not timeout:
            return
        while not self._failed.wait(min(timeout / 4, 0.25)):
            group = self._group
            if group is None:
                continue
            now = time.time()
            for slot in self.slots.all():
                if not slot.alive or slot.rank is None:
                    continue
                try:
                    age = now - os.stat(slot.heartbeat_file).st_mtime
                except FileNotFoundError:
                    continue  # not started stepping yet
                if age > timeout:
                    log.error("rank %d (%s) is frozen (no heartbeat for %.1fs): SIGKILL", slot.rank, slot.worker_id, age)
                    group.send_signal(slot.local_rank, signal.SIGKILL)
                    os.utime(slot.heartbeat_file)

    # --- completion ---------------------------------------------------------------------------------
    def _job_complete(self) -> bool:
        """Every rank of the newest generation exited 0 (read from the exit records)."""
        assert self._client is not None
        m = self._membership
        if m is None:
            return False
        exits, _ = self._client.get_prefix(self.keyspace.exits_prefix)
        ok = set()
        for kv in exits:
            doc = json.loads(kv.value)
            rank = int(doc.get("rank", -1))
            if 0 <= rank < m.world_size and doc.get("exitcode") == 0 and doc.get("worker_id") == m.worker_of(rank).worker_id:
                ok.add(rank)
        return len(ok) == m.world_size

    # --- main ------------------------------------------------------------------------------------------
    def run(self) -> AgentOutcome:
        import torch.distributed as dist  # deferred: importing torch costs ~2 s

        cfg = self.cfg
        self._install_signal_handlers()
        with ExitStack() as stack:
            stack.callback(shutil.rmtree, self._hb_dir, True)  # heartbeat files die with the agent
            etcd_config = self._connect_config(stack)
            client = EtcdClient(etcd_config)
            stack.callback(client.close)
            self._client = client
            session = Session(client, ttl_s=cfg.lease_ttl, name=self.node_id)
            stack.callback(session.close)

            host = cfg.local_addr or (cfg.master_addr if cfg.rdzv_endpoint is None else socket.getfqdn())
            store = dist.TCPStore(host, cfg.master_port or 0, is_master=True, wait_for_workers=False, use_libuv=True)
            me = NodeInfo(self.node_id, host, cfg.nproc_per_node, int(store.port))
            if self.recovery:
                # Campaign before the rendezvous: the first agent up leads, and a leader
                # exists by the time anything can fail.
                leader = RecoveryLeader(client, self.keyspace, session, host, int(store.port),
                                        LeaderConfig(cfg.run_id, cfg.replicas, cfg.placement),
                                        snapshot_step=self._snapshot_step)
                leader.start()
                stack.callback(leader.stop)
            if cfg.nproc_per_node == 0:
                # A spare-only node: not a rendezvous participant; it waits for the job to exist.
                Rendezvous(client, self.keyspace, session).register(me)
                self._membership = self._await_membership(client)
                m = self._membership
                result = RendezvousResult(0, 0, 1, (), 0, m.world_size, NodeInfo("", m.store_host, 1, m.store_port))
                log.info("spare node %s joined job %s (world %d)", self.node_id, cfg.run_id, m.world_size)
            else:
                result = Rendezvous(client, self.keyspace, session).join(
                    me, cfg.min_nodes, cfg.max_nodes, timeout_s=self.rendezvous_timeout_s)
                log.info("node %s joined round %d as node rank %d of %d (ranks %d..%d of %d)",
                         self.node_id, result.round, result.node_rank, result.nnodes, result.rank_offset,
                         result.rank_offset + cfg.nproc_per_node - 1, result.world_size)
                initial = Membership(0, result.world_size, result.master.host, result.master.store_port, tuple(
                    Assignment(p_off + lr, f"{p.node_id}/w{lr}", p.node_id, "survivor")
                    for p, p_off in _offsets(result.participants) for lr in range(p.nproc)
                ))
                self._membership = write_initial_membership(client, self.keyspace, initial) if self.recovery else initial
            self._result = result
            watch = client.watch_prefix(self.keyspace.prefix, self._on_events)
            stack.callback(watch.cancel)

            group = self._spawn(etcd_config, result, session)
            stack.callback(lambda: group.stop(timeout=cfg.shutdown_timeout))
            hang_thread = threading.Thread(target=self._watch_hangs, name="ckptless-hang", daemon=True)
            hang_thread.start()

            while not self._failed.is_set():
                self._wake.clear()
                session.check()
                if self.slots.all_assigned_succeeded() and (self._job_complete() or not self.recovery):
                    break
                self._wake.wait(0.5)
            code = 0
            if self._stop_signal is not None:
                code = 128 + self._stop_signal
            elif self._failed.is_set():
                code = 1
            group.stop(timeout=cfg.shutdown_timeout)
            self._failed.set()  # stops the hang watcher
            failed = tuple(self.slots.failed_ranks())
            return AgentOutcome(code, failed)
        raise AssertionError("unreachable")

    def _await_membership(self, client: EtcdClient) -> Membership:
        changed = threading.Event()
        watch = client.watch_prefix(self.keyspace.membership, lambda _e: changed.set())
        try:
            deadline = time.monotonic() + self.rendezvous_timeout_s
            while True:
                kv = client.get(self.keyspace.membership)
                if kv is not None:
                    return membership_from_json(kv.value)
                if time.monotonic() >= deadline:
                    raise RendezvousTimeout(f"spare node: job {self.cfg.run_id!r} did not start within "
                                            f"{self.rendezvous_timeout_s}s")
                changed.wait(min(0.5, deadline - time.monotonic()))
                changed.clear()
        finally:
            watch.cancel()

    def _snapshot_step(self, world_size: int) -> int | None:
        if not (self.cfg.snapshot_every and self.cfg.snapshot_dir):
            return None
        from ckptless.snapshot import latest_complete

        info = latest_complete(self.cfg.snapshot_dir, self.cfg.run_id, world_size)
        return None if info is None else info.step

    def _connect_config(self, stack: ExitStack) -> EtcdConfig:
        cfg = self.cfg
        if self._etcd_config is not None:
            return self._etcd_config
        if cfg.rdzv_endpoint is None:
            server = EmbeddedEtcd()
            server.start()
            stack.callback(server.close)
            log.info("started embedded etcd at %s", server.endpoint)
            return EtcdConfig((server.endpoint,))
        auth = {field: os.environ.get(var) or None for var, field in _AUTH_ENV.items()}
        return EtcdConfig((str(cfg.rdzv_endpoint),), user=auth["user"], password=auth["password"],
                          ca_cert=auth["ca_cert"], cert_key=auth["cert_key"], cert_cert=auth["cert_cert"])

    def _spawn(self, etcd_config: EtcdConfig, result: RendezvousResult, session: Session) -> WorkerGroup:
        cfg = self.cfg
        assert self._client is not None
        layout = WorkerLayout(
            node_rank=result.node_rank, nnodes=result.nnodes, nproc_per_node=max(cfg.nproc_per_node, 1),
            rank_offset=result.rank_offset, world_size=result.world_size,
            master_addr=result.master.host, master_port=result.master.store_port,
            run_id=cfg.run_id, role=cfg.role, restart_count=0, max_restarts=cfg.max_restarts,
        )
        common = {
            "CKPTLESS_ETCD_ENDPOINT": ",".join(etcd_config.endpoints),
            "CKPTLESS_JOB_ID": cfg.run_id,
            "CKPTLESS_NODE_ID": self.node_id,
            "CKPTLESS_GENERATION": "0",
            "CKPTLESS_REPLICAS": str(cfg.replicas),
            "CKPTLESS_MIRROR_EVERY": str(cfg.mirror_every),
            "CKPTLESS_PLACEMENT": cfg.placement,
        }
        if cfg.goodput_dir:
            common["CKPTLESS_GOODPUT_DIR"] = os.path.abspath(cfg.goodput_dir)
        if cfg.snapshot_every and cfg.snapshot_dir:
            common["CKPTLESS_SNAPSHOT_DIR"] = os.path.abspath(cfg.snapshot_dir)
            common["CKPTLESS_SNAPSHOT_EVERY"] = str(cfg.snapshot_every)
        envs = []
        for lr in range(cfg.nproc_per_node + cfg.spares):
            spare = lr >= cfg.nproc_per_node
            worker_id = f"{self.node_id}/spare{lr - cfg.nproc_per_node}" if spare else f"{self.node_id}/w{lr}"
            hb = os.path.join(self._hb_dir, f"hb{lr}")
            extra = dict(common, CKPTLESS_WORKER_ID=worker_id, CKPTLESS_HEARTBEAT_FILE=hb,
                         CKPTLESS_ROLE="spare" if spare else "member")
            env = worker_env(layout, min(lr, max(cfg.nproc_per_node, 1) - 1), os.environ, extra)
            if spare:
                env.pop("RANK", None)
                env["LOCAL_RANK"] = str(lr)
            envs.append(env)
            self.slots.add(Slot(lr, worker_id, None if spare else result.rank_offset + lr, hb))
        n = len(envs)
        redirects = tuple(cfg.redirects) + (Std.NONE,) * (n - len(cfg.redirects))
        tee = tuple(cfg.tee) + (Std.NONE,) * (n - len(cfg.tee))
        group = WorkerGroup([build_command(cfg)] * n, envs, on_exit=self._record_exit,
                            log_dir=cfg.log_dir, redirects=redirects, tee=tee)
        self._group = group
        group.start()
        for slot in self.slots.all():
            if slot.rank is None:  # a warm spare: in the pool, on our lease (gone with this node)
                self._client.put(f"{self.keyspace.spares_prefix}{slot.worker_id.replace('/', ':')}",
                                 spare_to_json(Worker(slot.worker_id, self.node_id)), lease=session.lease_id)
        return group


_AUTH_ENV = {
    "CKPTLESS_ETCD_USER": "user",
    "CKPTLESS_ETCD_PASSWORD": "password",
    "CKPTLESS_ETCD_CA_CERT": "ca_cert",
    "CKPTLESS_ETCD_CERT_KEY": "cert_key",
    "CKPTLESS_ETCD_CERT": "cert_cert",
}


def _offsets(participants: tuple[NodeInfo, ...]) -> list[tuple[NodeInfo, int]]:
    out, off = [], 0
    for p in participants:
        out.append((p, off))
        off += p.nproc
    return out
