"""The node agent behind ``ckptless-run``: one per node, long-lived.

Why a separate long-lived agent (as in torchelastic): the agent survives its
workers, so it can report their exits to etcd within milliseconds, host a
TCPStore (a store hosted by a worker dies with it), detect hung workers, run
the coordinator leader, keep warm spares, and respawn failed workers. It never
imports training code.

Lifecycle: connect to etcd (embedded when no endpoint) -> lease session ->
host a TCPStore -> rendezvous (node rank) -> initial membership -> leader
campaign -> spawn workers (+ spares) -> record exits (with the worker's own
classification: a user error ends the job, a fault is recovered), follow
memberships (respawn / kill / adopt a spare) -> exit when this node's ranks
finished, or the job's ``status`` says it failed (printing the root cause).

What the agent tolerates: an etcd outage (workers keep training; exit records
are queued until etcd is back; a job that finishes meanwhile exits 0) and a
pause longer than its lease (it re-registers under a new lease and follows
whatever the coordinator decided meanwhile).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from contextlib import ExitStack
from dataclasses import replace
from types import FrameType

from ckptless.coordinator.client import Compare, EtcdClient, Put, WatchEvent
from ckptless.coordinator.config import EtcdConfig
from ckptless.coordinator.embedded import EmbeddedEtcd
from ckptless.coordinator.keyspace import Keyspace
from ckptless.coordinator.rendezvous import NodeInfo, Rendezvous, RendezvousResult, RoundState
from ckptless.coordinator.session import Session
from ckptless.errors import CkptlessError, ConfigError, CoordinatorError, RendezvousError, RendezvousTimeout
from ckptless.launcher.args import LaunchConfig, Std
from ckptless.metrics import MetricsExporter
from ckptless.launcher import refill
from ckptless.launcher.joining import check_fingerprint, rank_offsets, resume_from_disk, script_fingerprint
from ckptless.launcher.node_metrics import update_node_metrics
from ckptless.launcher.outbox import OUTBOX_DRAIN_S, Outbox
from ckptless.launcher.slots import Slot, SlotTable
from ckptless.launcher.spares import SparePool
from ckptless.launcher.summary import render_failure
from ckptless.launcher.worker_env import WorkerLayout, build_command, ckptless_env_from_config, worker_env
from ckptless.launcher.watchdog import watch_hangs
from ckptless.launcher.workers import WorkerExit, WorkerGroup
from ckptless.recovery.facts import NodeLocalImage
from ckptless.recovery.leader import RecoveryLeader, write_initial_membership
from ckptless.recovery.leader_machine import LeaderConfig
from ckptless.recovery.plan import Assignment
from ckptless.recovery.view import ExitRecord, JobStatus
from ckptless.recovery.wire import Membership, membership_from_json
from ckptless.worker import exit_file
from ckptless.worker.heartbeat import read_progress
from ckptless.worker.ledger import leader_sink

log = logging.getLogger("ckptless.agent")
UNPORTED_WARN_S = float(os.environ.get("CKPTLESS_UNPORTED_WARN_S", "60"))  # see _warn_if_unported


class NodeAgent:
    def __init__(self, cfg: LaunchConfig, etcd_config: EtcdConfig | None = None, rendezvous_timeout_s: float = 900.0) -> None:
        self.cfg = cfg
        self._etcd_config = etcd_config
        self.rendezvous_timeout_s = float(cfg.rdzv_configs.get("join_timeout", rendezvous_timeout_s))
        self.keyspace = Keyspace(cfg.run_id)
        self.node_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.recovery = cfg.replicas > 0
        self._wake = threading.Event()
        self._stopping = threading.Event()  # a signal asked us to stop: every wait obeys it
        self._stop_signal: int | None = None
        self._status: JobStatus | None = None
        self._outbox = Outbox(lambda: self._client, self._stopping)
        self._client: EtcdClient | None = None
        self._session: Session | None = None
        self._leader: RecoveryLeader | None = None
        self._result: RendezvousResult | None = None
        self._group: WorkerGroup | None = None
        self._me: NodeInfo | None = None
        self.slots = SlotTable()
        self._membership: Membership | None = None
        self._membership_lock = threading.Lock()
        self._hb_dir = tempfile.mkdtemp(prefix="ckptless-hb-")
        self._local_failures: list[ExitRecord] = []
        self._store_port = 0
        self._host = ""
        self._metrics: MetricsExporter | None = None
        self._warm_started = False
        self._reexec_pending: set[int] = set()
        self.spares = SparePool(self.keyspace, self.node_id, lambda: self._client,
                                any_rank=cfg.spare_any_rank, refill=cfg.spare_refill)
        self._unported_warned = False
        self._lost_since: float | None = None  # when our lease was found lost and could not be renewed
        self._incident_t: dict[int, float] = {}  # generation -> when its incident opened (for metrics)
        self._published_t: dict[int, float] = {}

    # --- signals ---------------------------------------------------------------------
    @property
    def stop_signal(self) -> int | None:
        return self._stop_signal

    def _install_signal_handlers(self) -> None:
        def handler(signum: int, _frame: FrameType | None) -> None:
            self._stop_signal = signum
            if self._group is not None:
                self._group.signal_all(signum)
            self._stopping.set()
            self._wake.set()

        if threading.current_thread() is threading.main_thread():
            for name in self.cfg.signals_to_handle:
                sig = getattr(signal, name, None)
                if isinstance(sig, signal.Signals):
                    signal.signal(sig, handler)

    # --- exit records ---------------------------------------------------------------------
    def _exit_path(self, local_rank: int) -> str:
        return os.path.join(self._hb_dir, f"exit{local_rank}.json")

    def _record_exit(self, ex: WorkerExit) -> None:
        """Called by the reaper the moment a worker is reaped: into etcd first, then decide."""
        slot = self.slots.get(ex.local_rank)
        kind, error = exit_file.read(self._exit_path(ex.local_rank), pid=ex.pid)
        if kind == "reexec" and not ex.requested:
            # A pre-built spare assigned another rank than the one it built for: start it again
            # (warm) as that rank, under the same worker id. Not a failure: nothing is recorded.
            with self._membership_lock:
                self._reexec_pending.add(ex.local_rank)
            self._reexec_if_assigned(ex.local_rank)
            return
        rec = ExitRecord(rank=-1 if slot.rank is None else slot.rank, worker_id=slot.worker_id, node_id=self.node_id,
                         pid=ex.pid, exitcode=ex.exitcode, signal=ex.signal, time=ex.wall,
                         requested=ex.requested, kind=kind, error=error)
        self.slots.exited(ex.local_rank, ex.succeeded)
        # The node-local tier: checksum the own image the worker left in --shm-dir off the reaper
        # thread (~25 ms per 256 MiB), and record the version found intact with its exit.
        shm = self.cfg.shm_dir
        if slot.rank is not None and shm and self.recovery and rec.outcome == "fault":
            rank = slot.rank

            def with_local_image() -> bytes:
                from ckptless.mirror.ownimage import newest_verified

                try:
                    m = newest_verified(shm, self.cfg.run_id, self.node_id, rank)
                except Exception:  # never lose an exit record to a failed look at shm: peers have it
                    log.exception("rank %d: checking its node-local image failed", rank)
                    m = None
                img = None if m is None else NodeLocalImage(rank, self.node_id, m.version, len(m.chunk_checksums),
                                                            m.generation)
                return replace(rec, local_image=img).to_json()

            self._outbox.put(self.keyspace.worker_exit(rank), with_local_image, f"the exit of rank {rank}")
        elif slot.rank is not None:
            self._outbox.put(self.keyspace.worker_exit(slot.rank), rec.to_json(), f"the exit of rank {slot.rank}")
        else:  # a spare that died is never assigned: it leaves the pool at once, and says it died (the
            # leader may have assigned it a rank just before: it must see that worker dead at once)
            self._outbox.delete(self.spares.key(slot.worker_id), f"spare {slot.worker_id}")
            if not ex.succeeded:
                self._outbox.put(self.keyspace.spare_exit(slot.worker_id), rec.to_json(), f"the exit of {slot.worker_id}")
        if not ex.succeeded and not ex.requested:
            log.error("%s", rec.describe())
            if slot.rank is not None:
                self._local_failures.append(rec)
            if not self.recovery and slot.rank is not None and rec.outcome != "other":
                # No recovery: like torchrun, the first failure ends the job (first writer wins).
                self._send_status(JobStatus("failed", rec.describe(), rec))
        self._wake.set()

    def _send_status(self, status: JobStatus) -> None:
        try:
            assert self._client is not None
            self._client.txn([Compare(self.keyspace.status, "create", "==", 0)],
                             [Put(self.keyspace.status, status.to_json())])
        except CoordinatorError as exc:
            log.error("could not record the job's end in etcd: %s", exc)
        if self._status is None:
            self._status = status

    def _on_events(self, events: list[WatchEvent]) -> None:
        for ev in events:
            if ev.key == self.keyspace.membership and ev.kind == "put":
                self._apply_membership(membership_from_json(ev.value))
            elif ev.key == self.keyspace.status and ev.kind == "put":
                try:
                    self._status = JobStatus.from_json(ev.value)
                except CkptlessError:
                    self._status = JobStatus("failed", "the job's status record is malformed")
            elif ev.kind == "put" and ev.key.startswith(self.keyspace.prefix + "incident/g"):
                try:
                    g = int(ev.key.rsplit("/g", 1)[1])
                except ValueError:
                    continue
                if g not in self._incident_t:
                    self._incident_t[g] = time.monotonic()
                    if self._metrics is not None:
                        self._metrics.record_incident()
        self._wake.set()

    # --- memberships ---------------------------------------------------------------------------
    def _apply_membership(self, m: Membership) -> None:
        """Follow a new generation: adopt assigned spares, respawn here, kill the dropped."""
        with self._membership_lock:
            if self._membership is not None and m.generation <= self._membership.generation:
                return
            self._membership = m
            self._published_t.setdefault(m.generation, time.monotonic())
            if self._metrics is not None:
                self._metrics.set_generation(m.generation)
            group = self._group
            if group is None:
                return
            by_worker = {a.worker_id: a for a in m.ranks}
            for slot in self.slots.all():
                a = by_worker.get(slot.worker_id)
                if a is not None:
                    if slot.spare and slot.alive:
                        self.spares.took_rank()  # --spare-refill: the pool owes one
                    self.slots.assign(slot.local_rank, a.rank)
                elif slot.rank is not None:
                    if slot.alive:
                        log.warning("worker %s is not part of generation %d: killing it", slot.worker_id, m.generation)
                        group.send_signal(slot.local_rank, signal.SIGKILL)
                    self.slots.assign(slot.local_rank, None)  # its rank now runs elsewhere
            respawns = [a for a in m.ranks if a.node_id == self.node_id and a.source == "respawn"]
        if respawns:  # off the watch thread: each waits (bounded) for the process it replaces to be reaped
            threading.Thread(target=self._respawn_all, args=(group, respawns, m.generation),
                             name="ckptless-respawn", daemon=True).start()
        for lr in list(self._reexec_pending):
            self._reexec_if_assigned(lr)
        if self.cfg.shm_dir:  # a node lost on this host: its shm files go now, not at the end (issue 17)
            from ckptless.mirror.shm import remove_dead_groups

            remove_dead_groups(self.cfg.shm_dir, self.cfg.run_id)

    def _respawn_all(self, group: WorkerGroup, assignments: list[Assignment], generation: int) -> None:
        for a in assignments:
            self._respawn(group, a, generation)

    def _respawn(self, group: WorkerGroup, a: Assignment, generation: int) -> None:
        slot = self.slots.for_rank_slot(a.rank, self._result.rank_offset if self._result else 0)
        if slot is None or slot.worker_id == a.worker_id:
            return
        deadline = time.monotonic() + 10.0  # a SIGKILLed process is reaped within milliseconds
        while self.slots.get(slot.local_rank).alive and time.monotonic() < deadline:
            self._stopping.wait(0.01)  # until its exit is recorded under its own worker id
        if self.slots.get(slot.local_rank).alive:
            log.error("rank %d: the worker it replaces (%s) did not exit; not respawning", a.rank, slot.worker_id)
            return
        log.warning("respawning rank %d as %s (generation %d)", a.rank, a.worker_id, generation)
        self.slots.reset(slot.local_rank, a.worker_id, a.rank)
        for stale in (slot.heartbeat_file, self._exit_path(slot.local_rank)):
            try:  # the new incarnation must not be judged by its predecessor's files
                os.unlink(stale)
            except FileNotFoundError:
                pass
        try:
            group.respawn(slot.local_rank, {
                "CKPTLESS_WORKER_ID": a.worker_id, "CKPTLESS_ROLE": "replacement",
                "CKPTLESS_GENERATION": str(generation), "RANK": str(a.rank),
            })
        except CkptlessError:
            log.exception("respawn of rank %d failed", a.rank)

    def _reexec_if_assigned(self, local_rank: int) -> None:
        group, m = self._group, self._membership
        slot = self.slots.get(local_rank)
        with self._membership_lock:
            if local_rank not in self._reexec_pending or group is None or m is None or slot.rank is None:
                return  # the membership that assigns it has not reached us yet: _apply_membership calls again
            self._reexec_pending.discard(local_rank)
        exit_file.clear(self._exit_path(local_rank))
        log.warning("spare %s restarts as rank %d (generation %d)", slot.worker_id, slot.rank, m.generation)
        self.slots.reset(local_rank, slot.worker_id, slot.rank)
        try:  # its new incarnation must not be judged by the standby's last beat
            os.unlink(slot.heartbeat_file)
        except FileNotFoundError:
            pass
        try:
            group.respawn(local_rank, {"CKPTLESS_ROLE": "spare", "RANK": str(slot.rank),
                                       "CKPTLESS_GENERATION": str(m.generation), "CKPTLESS_STANDBY_RANK": ""})
        except CkptlessError:
            log.exception("restarting spare %s as rank %d failed", slot.worker_id, slot.rank)

    # --- hang detection ----------------------------------------------------------------------------
    def _watch_hangs(self) -> None:
        watch_hangs(self.cfg.hang_timeout, self.slots, lambda: self._group, self._stopping)

    # --- leases: survive a pause or an etcd outage longer than the TTL -------------------------------
    def _renew_session(self) -> None:
        """Our lease is gone (we were paused, or etcd was away): register again under a new one."""
        assert self._client is not None and self._me is not None
        old, self._session = self._session, None
        if self._lost_since is None:
            self._lost_since = time.monotonic()  # the lease is gone from now until a renewal succeeds
        try:
            # A short grant deadline: the main loop retries every turn, and while etcd is away a long
            # one would hold the loop (and every exit decision) for the client's whole call deadline.
            session = Session(self._client, ttl_s=self.cfg.lease_ttl, name=self.node_id,
                              grant_timeout_s=max(2.0, self.cfg.lease_ttl))
        except CoordinatorError as exc:
            self._session = old  # still done: try again on the next turn
            log.debug("renewing the lease failed: %s", exc)
            return
        self._lost_since = None
        self._session = session
        Rendezvous(self._client, self.keyspace, session).register(self._me)
        self.spares.offer_again([s.worker_id for s in self.slots.all() if s.spare and s.alive], session.lease_id)
        if self._leader is not None:
            self._leader.stop()
            self._leader = self._start_leader(session)
        log.warning("lease renewed after it was lost; this node is registered again")

    def _start_leader(self, session: Session) -> RecoveryLeader:
        cfg = self.cfg
        collective = float(os.environ.get("CKPTLESS_COLLECTIVE_TIMEOUT") or 60.0)
        leader = RecoveryLeader(self._client, self.keyspace, session, self._host, self._store_port,  # type: ignore[arg-type]
                                LeaderConfig(cfg.run_id, cfg.replicas, cfg.placement, node_grace_s=cfg.node_grace,
                                             alive_report_timeout_s=collective + 10.0),
                                snapshot_step=self._snapshot_step, on_event=leader_sink(cfg.goodput_dir))
        leader.start()
        return leader

    # --- completion ---------------------------------------------------------------------------------
    def _done(self) -> int | None:
        """The exit code once this agent is done, else None."""
        if self._stop_signal is not None:
            return 128 + self._stop_signal
        st = self._status
        if st is not None and st.state == "failed":
            return 1
        if self.slots.ever_ranked() and self.slots.all_assigned_succeeded():
            # Our ranks passed the final commit: the job's training is complete. The store's host
            # waits for the others' exit records (they may still need the store), but not on an
            # etcd that is gone: a finished job never exits non-zero (a scheduler reads that as
            # a failed job).
            if not self._hosts_store() or self._all_ranks_finished():
                return 0
            if self._etcd_gone_past_grace():
                print("ckptless-run: this node's ranks all finished the job; etcd has been unreachable for "
                      f"{time.monotonic() - (self._lost_since or 0.0):.0f}s, so the other nodes' exit records "
                      "cannot be read: leaving with success", file=sys.stderr, flush=True)
                return 0
        if st is not None and st.state == "succeeded":
            return 0
        if not self.slots.ever_ranked() and self._all_ranks_finished():
            return 0  # a spare-only node outlives nobody
        if self._cut_off():
            return 1
        return None

    def _etcd_gone_past_grace(self) -> bool:
        lost = self._lost_since
        return lost is not None and time.monotonic() - lost > self.cfg.node_grace + self.cfg.lease_ttl

    def _cut_off(self) -> bool:
        """Cut from etcd past the node grace with none of our workers left: the job went on without us.

        While etcd is merely down for everyone, our workers keep training and we stay;
        only once they have all ended (not by finishing) is there nothing left to wait for.
        """
        if not self.slots.ever_ranked() or not self._etcd_gone_past_grace():
            return False
        if any(s.alive for s in self.slots.all() if s.rank is not None):
            return False
        lost = self._lost_since or 0.0
        print(f"ckptless-run: this node was cut off from etcd for {time.monotonic() - lost:.0f}s (more than "
              f"--node-grace {self.cfg.node_grace:.0f}s) and its workers have ended: its ranks were re-planned "
              "elsewhere; leaving", file=sys.stderr, flush=True)
        return True

    def _hosts_store(self) -> bool:
        """This agent hosts the current generation's store (others may still need it to finish)."""
        m = self._membership
        return m is not None and m.store_port == self._store_port and m.store_host == self._host

    def _all_ranks_finished(self) -> bool:
        m = self._membership
        if m is None or self._client is None:
            return False
        try:
            # A poll of the main loop: a short deadline, so an etcd that is gone does not hold the loop
            # (and the lease renewal that notices the outage) for the client's whole call deadline.
            exits, _ = self._client.get_prefix(self.keyspace.exits_prefix, timeout_s=2.0)
        except CoordinatorError:
            return False
        ok = set()
        for kv in exits:
            try:
                rec = ExitRecord.from_json(kv.value)
            except CkptlessError:
                continue
            if 0 <= rec.rank < m.world_size and rec.exitcode == 0 and rec.worker_id == m.worker_of(rec.rank).worker_id:
                ok.add(rec.rank)
        return len(ok) == m.world_size

    # --- main ------------------------------------------------------------------------------------------
    def run(self) -> AgentOutcome:
        import torch.distributed as dist  # deferred: importing torch costs ~2 s

        cfg = self.cfg
        self._install_signal_handlers()
        with ExitStack() as stack:
            stack.callback(shutil.rmtree, self._hb_dir, True)  # heartbeat/exit files die with the agent
            etcd_config = self._connect_config(stack)
            client = EtcdClient(etcd_config)
            stack.callback(client.close)
            self._client = client
            self._session = Session(client, ttl_s=cfg.lease_ttl, name=self.node_id)
            stack.callback(lambda: self._session.close() if self._session is not None else None)

            self._host = cfg.local_addr or (cfg.master_addr if cfg.rdzv_endpoint is None else socket.getfqdn())
            store = dist.TCPStore(self._host, cfg.master_port or 0, is_master=True, wait_for_workers=False,
                                  use_libuv=True)
            self._store_port = int(store.port)
            me = self._me = NodeInfo(self.node_id, self._host, cfg.nproc_per_node, self._store_port)
            if self.recovery:
                # Campaign before the rendezvous: the first agent up leads, and a leader
                # exists by the time anything can fail.
                self._leader = self._start_leader(self._session)
                stack.callback(lambda: self._leader.stop() if self._leader is not None else None)
            self._start_metrics(stack)
            self._prepare_shm(stack)
            result = self._join(client, me)
            self._result = result
            if result.world_size < 2 or cfg.replicas == 0:
                self._without_recovery(result.world_size)
            elif cfg.replicas >= result.world_size:
                raise ConfigError("replicas", cfg.replicas,
                                  f"must be < the world size ({result.world_size}): a rank's K mirrors live on other ranks")
            watch = client.watch_prefix(self.keyspace.prefix, self._on_events)
            stack.callback(watch.cancel)
            self._status = self._read_status()

            group = self._spawn(etcd_config, result)
            stack.callback(lambda: group.stop(timeout=cfg.shutdown_timeout))
            threading.Thread(target=self._watch_hangs, name="ckptless-hang", daemon=True).start()

            code = None
            spawned_at = time.monotonic()
            while code is None:
                self._wake.wait(0.5)
                self._wake.clear()
                if self._session is not None and self._session.done.is_set():
                    self._renew_session()
                self._update_metrics()
                self._warn_if_unported(spawned_at)
                self._maybe_warm(group)
                self._maybe_refill(group)
                code = self._done()
            if code == 0:
                self._warn_if_unported(spawned_at, at_end=True)
            # Pending exit records get their time to land, unless etcd is known to be gone.
            self._outbox.drain(timeout=1.0 if self._lost_since is not None else OUTBOX_DRAIN_S)
            self._stopping.set()  # stops the hang watcher and the outbox retries
            group.stop(timeout=cfg.shutdown_timeout)
            if code == 1 and self._status is not None:
                self._print_failure(self._status)
            return AgentOutcome(code, tuple(self.slots.failed_ranks()))
        raise AssertionError("unreachable")

    def _join(self, client: EtcdClient, me: NodeInfo) -> RendezvousResult:
        cfg = self.cfg
        assert self._session is not None
        if cfg.nproc_per_node == 0:
            # A spare-only node: not a rendezvous participant; it waits for the job to exist.
            Rendezvous(client, self.keyspace, self._session).register(me)
            self._membership = m = self._await_membership(client)
            check_fingerprint(client, self.keyspace, cfg)
            log.info("spare node %s joined job %s (world %d)", self.node_id, cfg.run_id, m.world_size)
            return RendezvousResult(0, 0, 1, (), 0, m.world_size, NodeInfo("", m.store_host, 1, m.store_port))
        result = Rendezvous(client, self.keyspace, self._session).join(
            me, cfg.min_nodes, cfg.max_nodes, timeout_s=self.rendezvous_timeout_s, stop=self._stopping)
        client.txn([Compare(self.keyspace.fingerprint(result.round), "create", "==", 0)],
                   [Put(self.keyspace.fingerprint(result.round), script_fingerprint(cfg))])
        log.info("node %s joined round %d as node rank %d of %d (ranks %d..%d of %d)",
                 self.node_id, result.round, result.node_rank, result.nnodes, result.rank_offset,
                 result.rank_offset + cfg.nproc_per_node - 1, result.world_size)
        ranks = tuple(Assignment(p_off + lr, f"{p.node_id}/w{lr}", p.node_id, "survivor")
                      for p, p_off in rank_offsets(result.participants) for lr in range(p.nproc))
        resume = resume_from_disk(cfg, result.world_size, ranks, result.node_rank)  # every node: may refuse
        initial = Membership(0, result.world_size, result.master.host, result.master.store_port, ranks, resume)
        if self.recovery and result.world_size > 1:
            self._membership = write_initial_membership(
                client, self.keyspace, initial, result.round, writer=result.node_rank == 0,
                deadline=time.monotonic() + self.rendezvous_timeout_s)
        else:
            self._membership = initial
        return result

    def _warn_if_unported(self, spawned_at: float, at_end: bool = False) -> None:
        """A script that never calls ``ckptless.init()`` trains unprotected: say so once, early (no rank of
        this node wrote a heartbeat, which ``ckptless.init()`` starts, within UNPORTED_WARN_S), or at the
        end of a job shorter than that."""
        if self._unported_warned or not self.recovery or (
                not at_end and time.monotonic() - spawned_at < UNPORTED_WARN_S):
            return
        ranked = [s for s in self.slots.all() if s.rank is not None]
        if not ranked or any(read_progress(s.heartbeat_file) is not None for s in ranked):
            self._unported_warned = True  # ported (or nothing to say)
            return
        if not at_end and not all(s.alive for s in ranked):
            return
        self._unported_warned = True
        print(f"ckptless-run: warning: no worker of this node called ckptless.init() within {UNPORTED_WARN_S:.0f}s: "
              "the script runs unprotected (a failure will not be recovered; it still calls "
              "init_process_group itself?). See docs/porting.md.", file=sys.stderr, flush=True)

    def _maybe_warm(self, group: WorkerGroup) -> None:
        """Start the fork server once every local rank reached ``ckptless.init()`` (its heartbeat file
        exists): their own ``import torch`` is done, so the server's does not delay it, and a failure
        during the setup or the first steps already finds a warm respawn (waiting for the first
        trained step instead left the job without one for 4-30 s, 19.5 s at W32 here)."""
        if self._warm_started or not group.warm_enabled:
            return
        ranked = [s for s in self.slots.all() if s.rank is not None and s.alive]
        progress = [read_progress(s.heartbeat_file) for s in ranked]
        if ranked and all(p is not None for p in progress):
            self._warm_started = True
            threading.Thread(target=group.start_server, name="ckptless-warm", daemon=True).start()

    def _maybe_refill(self, group: WorkerGroup) -> None:
        """--spare-refill: start a new spare once one of ours took a rank and that recovery is over."""
        m = self._membership
        if (not self.spares.refill_owed or m is None or self._stopping.is_set() or self._status is not None
                or m.generation in self._incident_t  # another failure: wait for its recovery too
                or not refill.recovery_over(self.slots.all(), m.generation, read_progress)):
            return
        if refill.spares_missing(self.slots.all(), self.cfg.spares) == 0:
            self.spares.next_refill(self.cfg.spares)  # the pool is full (e.g. a slot came back): nothing owed
            return
        try:  # etcd may be away: keep the refill owed and try again on a later turn
            ranks = self.spares.standby_ranks(m.world_size, 1) if self.cfg.spare_prebuild else []
        except CoordinatorError as exc:
            log.info("spare refill waits for etcd: %s", exc)
            return
        worker_id = self.spares.next_refill(self.cfg.spares)
        if worker_id is None:
            return
        standby = ranks[0] if ranks else None
        lr = group.size  # add_like appends the next local rank; only this loop adds workers
        hb = os.path.join(self._hb_dir, f"hb{lr}")
        self.slots.add(Slot(lr, worker_id, None, hb))
        # The store of the current generation (node 0's may be gone with its node): a pre-built spare
        # connects to it while it builds, long before it is assigned a rank.
        env = dict(refill.spare_env(worker_id, lr, hb, self._exit_path(lr), standby),
                   MASTER_ADDR=m.store_host, MASTER_PORT=str(m.store_port))
        try:
            added = group.add_like(self.cfg.nproc_per_node, env)
        except CkptlessError:
            log.exception("starting spare %s failed (not retried: a broken start must not loop)", worker_id)
            self.slots.exited(lr, False)
            return
        assert added == lr, (added, lr)
        assert self._session is not None
        self.spares.offer_quietly(worker_id, standby, self._session.lease_id)  # on our lease, like the first
        log.warning("spare %s started (standby rank %s) in place of the one that took a rank", worker_id, standby)

    def _start_metrics(self, stack: ExitStack) -> None:
        if self.cfg.metrics_port is None:
            return
        self._metrics = MetricsExporter(job_id=self.cfg.run_id, node_id=self.node_id)
        port = self._metrics.start(port=self.cfg.metrics_port, host="0.0.0.0")
        stack.callback(self._metrics.stop)
        print(f"ckptless-run: metrics at http://{self._host}:{port}/metrics", file=sys.stderr, flush=True)

    def _update_metrics(self) -> None:
        """Telemetry never ends a job: whatever reading the gauges' inputs raises is logged, not raised."""
        if self._metrics is None:
            return
        try:
            update_node_metrics(self._metrics, self.slots.all(), self._membership, self._incident_t, self._published_t)
        except Exception as exc:  # noqa: BLE001 - a gauge must not fail the agent loop
            log.warning("metrics not updated: %s", exc)

    def _prepare_shm(self, stack: ExitStack) -> None:
        """Node-local replicas: clear files of dead jobs, own this job's, remove them at the end."""
        d = self.cfg.shm_dir
        if not d:
            return
        from ckptless.mirror.shm import cleanup_stale, finish_job, register_owner

        os.makedirs(d, exist_ok=True)
        cleanup_stale(d)
        register_owner(d, self.cfg.run_id, node=self.node_id)
        stack.callback(lambda: finish_job(d, self.cfg.run_id, self.node_id))

    def _without_recovery(self, world_size: int) -> None:
        """World size 1 (nothing to mirror to) or --replicas 0: a failure ends the job, like torchrun."""
        if self.recovery:
            log.warning("world size %d: there is no peer to mirror to; recovery is off (a failure ends the job, "
                        "like torchrun --max-restarts 0)", world_size)
        self.recovery = False
        if self._leader is not None:
            self._leader.stop()
            self._leader = None

    def _read_status(self) -> JobStatus | None:
        assert self._client is not None
        kv = self._client.get(self.keyspace.status)
        return None if kv is None else JobStatus.from_json(kv.value)

    def _print_failure(self, status: JobStatus) -> None:
        lr = {s.rank: s.local_rank for s in self.slots.all() if s.rank is not None}
        text = render_failure(self.cfg.training_script, status, self._local_failures, lr)
        print(text, file=sys.stderr, flush=True)

    def _await_membership(self, client: EtcdClient) -> Membership:
        changed = threading.Event()
        watch = client.watch_prefix(self.keyspace.membership, lambda _e: changed.set())
        try:
            deadline = time.monotonic() + self.rendezvous_timeout_s
            while True:
                if self._stopping.is_set():
                    raise RendezvousError(f"spare node: waiting for job {self.cfg.run_id!r} interrupted")
                kv = client.get(self.keyspace.membership)
                if kv is not None and self._membership_is_current(client):
                    return membership_from_json(kv.value)
                if time.monotonic() >= deadline:
                    raise RendezvousTimeout(f"spare node: job {self.cfg.run_id!r} did not start within "
                                            f"{self.rendezvous_timeout_s}s")
                changed.wait(min(0.25, deadline - time.monotonic()))
                changed.clear()
        finally:
            watch.cancel()

    def _membership_is_current(self, client: EtcdClient) -> bool:
        """The membership belongs to the current rendezvous round (not a previous run of this job id)."""
        state, rnd = client.get(self.keyspace.rdzv_state), client.get(self.keyspace.round)
        if state is None or rnd is None:
            return False
        st = RoundState.from_bytes(state.value)
        return st.state == "closed" and int(rnd.value) == st.round

    def _snapshot_step(self, world_size: int, exclude: frozenset[int] = frozenset()) -> int | None:
        """The newest snapshot whose content verifies (corrupt or excluded ones are skipped, and said so)."""
        if not (self.cfg.snapshot_every and self.cfg.snapshot_dir):
            return None
        from ckptless.snapshot import choose_snapshot

        info, rejected = choose_snapshot(self.cfg.snapshot_dir, self.cfg.run_id, world_size, exclude=exclude)
        for step, why in rejected:
            log.warning("not restoring snapshot step %d: %s", step, why)
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
        return EtcdConfig.from_env((str(cfg.rdzv_endpoint),))

    def _spawn(self, etcd_config: EtcdConfig, result: RendezvousResult) -> WorkerGroup:
        cfg = self.cfg
        assert self._client is not None and self._session is not None
        layout = WorkerLayout(
            node_rank=result.node_rank, nnodes=result.nnodes, nproc_per_node=max(cfg.nproc_per_node, 1),
            rank_offset=result.rank_offset, world_size=result.world_size,
            master_addr=result.master.host, master_port=result.master.store_port,
            run_id=cfg.run_id, role=cfg.role, restart_count=0, max_restarts=cfg.max_restarts,
        )
        common = ckptless_env_from_config(cfg, etcd_endpoint=",".join(etcd_config.endpoints), node_id=self.node_id,
                                          generation=0, recovery=self.recovery)
        envs = []
        standby = self.spares.standby_ranks(result.world_size, cfg.spares)
        standby_of: dict[int, int | None] = {}  # a spare's local rank -> the rank it pre-builds as
        for lr in range(cfg.nproc_per_node + cfg.spares):
            spare = lr >= cfg.nproc_per_node
            worker_id = f"{self.node_id}/spare{lr - cfg.nproc_per_node}" if spare else f"{self.node_id}/w{lr}"
            hb = os.path.join(self._hb_dir, f"hb{lr}")
            extra = dict(common, CKPTLESS_WORKER_ID=worker_id, CKPTLESS_HEARTBEAT_FILE=hb,
                         CKPTLESS_EXIT_FILE=self._exit_path(lr), CKPTLESS_ROLE="spare" if spare else "member")
            extra.setdefault("CKPTLESS_PRELOAD", os.environ.get("CKPTLESS_PRELOAD", "ckptless.job"))
            env = worker_env(layout, min(lr, max(cfg.nproc_per_node, 1) - 1), os.environ, extra)
            if spare:  # the same spare env a --spare-refill spare gets (launcher/refill.py)
                sb = standby[lr - cfg.nproc_per_node] if standby and cfg.spare_prebuild else None
                standby_of[lr] = sb
                env.update(refill.spare_env(worker_id, lr, hb, self._exit_path(lr), sb))
            envs.append(env)
            self.slots.add(Slot(lr, worker_id, None if spare else result.rank_offset + lr, hb))
        n = len(envs)
        redirects = tuple(cfg.redirects) + (Std.NONE,) * (n - len(cfg.redirects))
        tee = tuple(cfg.tee) + (Std.NONE,) * (n - len(cfg.tee))
        # Warm respawns (a fork server with torch imported) only where a respawn can happen.
        group = WorkerGroup([build_command(cfg)] * n, envs, on_exit=self._record_exit,
                            log_dir=cfg.log_dir, redirects=redirects, tee=tee,
                            warm=cfg.warm_respawn and self.recovery, role=cfg.role)
        self._group = group
        group.start(start_server=False)  # the fork server starts once our workers train (see _maybe_warm)
        for slot in self.slots.all():
            if slot.rank is None:  # a warm spare: in the pool, on our lease (gone with this node)
                self.spares.offer(slot.worker_id, standby_of[slot.local_rank], self._session.lease_id)
        if cfg.nproc_per_node == 0 and group.warm_enabled:  # nothing trains here: warm it now
            self._warm_started = True
            threading.Thread(target=group.start_server, name="ckptless-warm", daemon=True).start()
        return group


class AgentOutcome:
    def __init__(self, exit_code: int, failed_ranks: tuple[int, ...]) -> None:
        self.exit_code = exit_code
        self.failed_ranks = failed_ranks
