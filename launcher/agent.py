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

This module wires the parts and owns the connections (etcd, lease, leader,
TCPStore), the first spawn and the main loop. What the agent decides (kills,
respawns, re-execs, refills, its exit code) is one pure machine
(launcher/node_machine.py), driven by launcher/node_driver.py; the parts,
each over the I/O handles the agent's threads share (launcher/node_state.py),
turn what they observe into its events or carry out its actions: joining the
job (launcher/joining.py), recording exits (launcher/exit_records.py),
following memberships (launcher/follower.py), respawns and re-execs
(launcher/respawn.py), spare refills (launcher/refill.py), hang detection
(launcher/watchdog.py) and the job's end (launcher/completion.py).
"""

from __future__ import annotations

import dataclasses
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
from types import FrameType

from ckptless import environment
from ckptless.coordinator import EtcdClient, WatchEvent
from ckptless.coordinator import RelayServer
from ckptless.coordinator import RelayWriter
from ckptless.coordinator import EtcdConfig
from ckptless.coordinator import EmbeddedEtcd
from ckptless.coordinator import NodeInfo, Rendezvous, RendezvousResult
from ckptless.coordinator import Session
from ckptless.errors import ConfigError, CoordinatorError
from ckptless.launcher.mirror_link import LinkCheck
from ckptless.launcher import admission, completion, devices, follower, refill
from ckptless.launcher.args import LaunchConfig, Std
from ckptless.launcher.spares import SparePool
from ckptless.launcher.completion import AgentOutcome
from ckptless.launcher.exit_records import record_exit
from ckptless.launcher.joining import join
from ckptless.launcher.node_driver import NodeDriver
from ckptless.launcher.node_machine import (
    LeaseLost, LeaseRenewed, MembershipSeen, NodeConfig, Spawned, StatusSeen, StopRequested)
from ckptless.launcher.node_metrics import update_node_metrics
from ckptless.launcher.node_state import NodeState
from ckptless.launcher.outbox import OUTBOX_DRAIN_S
from ckptless.launcher.slots import Slot
from ckptless.launcher.watchdog import end_stuck_teardowns, watch_hangs
from ckptless.launcher.worker_env import WorkerLayout, build_command, ckptless_env_from_config, worker_env
from ckptless.launcher.workers import WorkerGroup
from ckptless.metrics import MetricsExporter
from ckptless.recovery import RecoveryLeader
from ckptless.recovery import LeaderConfig
from ckptless.worker import spare_site
from ckptless.worker import read_progress
from ckptless.worker import leader_sink

log = logging.getLogger("ckptless.agent")


class NodeAgent:
    def __init__(self, cfg: LaunchConfig, etcd_config: EtcdConfig | None = None, rendezvous_timeout_s: float = 900.0) -> None:
        self.cfg = cfg
        self._etcd_config = etcd_config
        self.rendezvous_timeout_s = float(cfg.rdzv_configs.get("join_timeout", rendezvous_timeout_s))
        self.node_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        # Before anything starts: spares without a GPU of their own are refused in one line.
        gpus, source = devices.node_gpus(environment.current(), environment.environ())
        devices.check_spares(gpus, source, cfg.nproc_per_node, cfg.spares)
        if gpus:
            log.info("this node offers %d GPUs (%s)", gpus, source)
        self.state = NodeState(cfg, self.node_id, tempfile.mkdtemp(prefix="ckptless-hb-"), gpus)
        self._leader: RecoveryLeader | None = None
        self._me: NodeInfo | None = None
        self._link: LinkCheck | None = None  # links/<node>: put back under a renewed lease
        self._warm_started = False
        self._unported_warned = False
        self._driver: NodeDriver | None = None  # the node machine's driver, once the job formed

    # --- signals ---------------------------------------------------------------------
    @property
    def stop_signal(self) -> int | None:
        return self.state.stop_signal

    def _install_signal_handlers(self) -> None:
        st = self.state

        def handler(signum: int, _frame: FrameType | None) -> None:
            st.stop_signal = signum
            if st.group is not None:
                st.group.signal_all(signum)
            st.stopping.set()
            st.wake.set()

        if threading.current_thread() is threading.main_thread():
            for name in self.cfg.signals_to_handle:
                sig = getattr(signal, name, None)
                if isinstance(sig, signal.Signals):
                    signal.signal(sig, handler)

    # --- hang detection ----------------------------------------------------------------------------
    def _watch_hangs(self) -> None:
        watch_hangs(self.cfg.hang_timeout, self.state.slots, self.state.feed, self.state.stopping)

    # --- leases: survive a pause or an etcd outage longer than the TTL -------------------------------
    def _renew_session(self) -> None:
        """Our lease is gone (we were paused, or etcd was away): register again under a new one."""
        st = self.state
        assert st.client is not None and self._me is not None
        old, st.session = st.session, None
        st.feed(LeaseLost())  # the lease is gone from now until a renewal succeeds
        try:
            # A short grant deadline: the main loop retries every turn, and while etcd is away a long
            # one would hold the loop (and every exit decision) for the client's whole call deadline.
            session = Session(st.client, ttl_s=self.cfg.lease_ttl, name=self.node_id,
                              grant_timeout_s=max(2.0, self.cfg.lease_ttl))
        except CoordinatorError as exc:
            st.session = old  # still done: try again on the next turn
            log.debug("renewing the lease failed: %s", exc)
            return
        st.feed(LeaseRenewed())
        st.session = session
        Rendezvous(st.client, st.keyspace, session).register(self._me)
        if self._link is not None:
            self._link.republish(session.lease_id)
        st.spares.offer_again([s.worker_id for s in st.slots.all() if s.spare and s.alive], session.lease_id)
        if self._leader is not None:
            self._leader.stop()
            self._leader = self._start_leader(session)
        log.warning("lease renewed after it was lost; this node is registered again")

    def _orphaned_ranks(self) -> list[int]:
        """Ranks of the current membership whose node is gone (no live node key), and ranks a survivor
        hosts (fewer ranks): what a spare started now is most likely to take, so it pre-builds as one
        of them. One etcd read."""
        st = self.state
        m = self._driver.node.membership if self._driver is not None else None
        if m is None or st.client is None:
            return []
        kvs, _ = st.client.get_prefix(st.keyspace.nodes_prefix)
        live = {kv.key[len(st.keyspace.nodes_prefix):] for kv in kvs}
        return sorted(a.rank for a in m.ranks if a.node_id not in live or a.source == "hosted")

    def _serve_as_spares(self) -> LaunchConfig:
        """This node arrived after the job formed: from now on it is a spare-only node whose spares are
        its --nproc-per-node workers (and its --spares), pre-built as the ranks whose node is gone, with
        the spare flags it was given (--no-spare-prebuild, --no-spare-any-rank) like any spare."""
        st = self.state
        old = self.cfg
        cfg = dataclasses.replace(old, nproc_per_node=0, spares=old.nproc_per_node + old.spares)
        self.cfg = st.cfg = cfg
        st.spares = SparePool(st.keyspace, self.node_id, lambda: st.client, any_rank=cfg.spare_any_rank)
        if self._me is not None:  # re-registered after a lease renewal: as the spare-only node it is now
            self._me = dataclasses.replace(self._me, nproc=0)
        return cfg

    def _start_leader(self, session: Session) -> RecoveryLeader:
        cfg, st = self.cfg, self.state
        assert st.client is not None  # connected before any leader starts
        collective = environment.current().collective_timeout_s or 60.0
        leader = RecoveryLeader(st.client, st.keyspace, session, st.host, st.store_port,
                                LeaderConfig(cfg.run_id, cfg.replicas, cfg.placement, node_grace_s=cfg.node_grace,
                                             alive_report_timeout_s=collective + 10.0,
                                             replacement_timeout_s=cfg.replacement_timeout,
                                             lost_node=cfg.lost_node, min_nodes=cfg.min_nodes),
                                snapshot_step=self._snapshot_step, on_event=leader_sink(cfg.goodput_dir))
        leader.start()
        return leader

    # --- main ------------------------------------------------------------------------------------------
    def run(self) -> AgentOutcome:
        import torch.distributed as dist  # deferred: importing torch costs ~2 s

        cfg, st = self.cfg, self.state
        self._install_signal_handlers()
        with ExitStack() as stack:
            stack.callback(shutil.rmtree, st.hb_dir, True)  # heartbeat/exit files die with the agent
            etcd_config = self._connect_config(stack)
            client = EtcdClient(etcd_config)
            stack.callback(client.close)
            st.client = client
            # Before this agent writes anything (its lease, node key, leader campaign): a job that has ended
            # is reported and left as it is (JobAlreadyEnded: one line, its outcome as the exit code), and an
            # agent that disagrees with a live round, or with an ended run, is refused (launcher/admission.py).
            log.info("node %s: reading job %r's records", self.node_id, cfg.run_id)
            relaunch = admission.admit(client, st.keyspace, cfg, environment.environ())
            if relaunch is not None:
                print(f"ckptless-run: {relaunch.line}", file=sys.stderr, flush=True)
            st.session = Session(client, ttl_s=cfg.lease_ttl, name=self.node_id)
            stack.callback(lambda: st.session.close() if st.session is not None else None)

            st.host = cfg.local_addr or (cfg.master_addr if cfg.rdzv_endpoint is None else socket.getfqdn())
            store = dist.TCPStore(st.host, cfg.master_port or 0, is_master=True, wait_for_workers=False,
                                  use_libuv=True)
            st.store_port = int(store.port)
            me = self._me = NodeInfo(self.node_id, st.host, cfg.nproc_per_node, st.store_port)
            if st.recovery:
                # Campaign before the rendezvous: the first agent up leads, and a leader
                # exists by the time anything can fail.
                self._leader = self._start_leader(st.session)
                stack.callback(lambda: self._leader.stop() if self._leader is not None else None)
            self._start_metrics(stack)
            link = self._link = LinkCheck(client, st.keyspace, self.node_id, cfg.local_addr,
                             st.slots.gpus > 0 and environment.current().cuda_backend in (None, "nccl"),
                             st.metrics, cfg.goodput_dir)
            link.publish(st.session.lease_id)  # the mirrors' interface and address, named before anything runs
            stack.callback(link.close)
            self._prepare_shm(stack)
            result, initial = join(client, st.keyspace, st.session, me, cfg, recovery=st.recovery,
                                   timeout_s=self.rendezvous_timeout_s, stopping=st.stopping, relaunch=relaunch)
            if result.late:
                cfg = self._serve_as_spares()
            else:
                link.measure(result)  # once, on its own thread: 0.3 s to the next node
            if result.world_size < 2 or cfg.replicas == 0:
                self._without_recovery(result.world_size)
            elif cfg.replicas >= result.world_size:
                raise ConfigError("replicas", cfg.replicas,
                                  f"must be < the world size ({result.world_size}): a rank's K mirrors live on other ranks")
            # One watch of job/ per node: the follower's, relayed to the node's workers (coordinator/relay_server.py);
            # their writes come back through it and go to etcd in batches (coordinator/relay_writer.py).
            driver = self._driver = NodeDriver(st, NodeConfig(
                self.node_id, st.host, st.store_port, node_grace_s=cfg.node_grace, lease_ttl_s=cfg.lease_ttl,
                recovery=st.recovery, shm=bool(cfg.shm_dir), rank_offset=result.rank_offset, spares=cfg.spares,
                spare_refill=cfg.spare_refill, hang_timeout_s=cfg.hang_timeout, shutdown_timeout_s=cfg.shutdown_timeout))
            st.feed = driver.feed
            driver.feed(MembershipSeen(initial, ()))  # generation 0, as the rendezvous left it
            relay = st.relay = RelayServer(writer=RelayWriter(lambda: st.client, st.keyspace.worker_writes))
            stack.callback(relay.close)

            def on_job_events(events: list[WatchEvent]) -> None:
                relay.on_events(events)
                follower.on_events(st, events)

            watch = client.watch_prefix(st.keyspace.job_prefix, on_job_events)
            stack.callback(watch.cancel)
            relay.seed(client.get_prefix(st.keyspace.job_prefix)[0])  # what was there before the watch
            status = completion.read_status(st)
            if status is not None:
                driver.feed(StatusSeen(status))

            group = self._spawn(etcd_config, result)
            stack.callback(lambda: group.stop(timeout=cfg.shutdown_timeout))
            threading.Thread(target=self._watch_hangs, name="ckptless-hang", daemon=True).start()

            spawned_at = time.monotonic()
            node = driver.node
            while node.exit_code is None:
                st.wake.wait(0.5)
                st.wake.clear()
                if st.session is not None and st.session.done.is_set():
                    self._renew_session()
                self._update_metrics()
                self._warn_if_unported(spawned_at)
                self._maybe_warm(group)
                end_stuck_teardowns(group, st.exit_path, cfg.shutdown_timeout, driver.feed)
                if st.stop_signal is not None:
                    driver.feed(StopRequested(st.stop_signal))
                node = driver.tick()  # the machine decides on a spare refill, and whether this node's part is over
            code = node.exit_code
            if code == 0:
                self._warn_if_unported(spawned_at, at_end=True)
            # Pending exit records get their time to land, unless etcd is known to be gone.
            st.outbox.drain(timeout=1.0 if node.lost_since is not None else OUTBOX_DRAIN_S)
            st.stopping.set()  # stops the hang watcher and the outbox retries
            group.stop(timeout=cfg.shutdown_timeout)
            node = driver.node  # a status the watch brought meanwhile is printed too
            if code == 1 and node.status is not None:
                completion.print_failure(st, node.status, node.local_failures)
            return AgentOutcome(code, tuple(st.slots.failed_ranks()))
        raise AssertionError("unreachable")

    def _warn_if_unported(self, spawned_at: float, at_end: bool = False) -> None:
        """A script that never calls ``ckptless.init()`` trains unprotected: say so once, early (no rank of
        this node wrote a heartbeat, which ``ckptless.init()`` starts, within ``CKPTLESS_UNPORTED_WARN_S``,
        read when it is needed), or at the end of a job shorter than that."""
        warn_s = environment.current().unported_warn_s
        if self._unported_warned or not self.state.recovery:
            return
        ranked = [s for s in self.state.slots.all() if s.rank is not None]
        # Looked at every time, not only once the warning is due: a worker that finishes removes its
        # heartbeat file, so a job shorter than the delay was warned about at its end (seen in every
        # short e2e job's log).
        if not ranked:
            return  # nothing to say yet (a spare-only node's spares have no rank)
        if any(read_progress(s.heartbeat_file) is not None for s in ranked):
            self._unported_warned = True  # ported
            return
        if not at_end and time.monotonic() - spawned_at < warn_s:
            return
        if not at_end and not all(s.alive for s in ranked):
            return
        self._unported_warned = True
        print(f"ckptless-run: warning: no worker of this node called ckptless.init() within {warn_s:.0f}s: "
              "the script runs unprotected (a failure will not be recovered; it still calls "
              "init_process_group itself?). See docs/porting.md.", file=sys.stderr, flush=True)

    def _maybe_warm(self, group: WorkerGroup) -> None:
        """Start the fork server once every local rank reached ``ckptless.init()`` (its heartbeat file
        exists): their own ``import torch`` is done, so the server's does not delay it, and a failure
        during the setup or the first steps already finds a warm respawn (waiting for the first
        trained step instead left the job without one for 4-30 s, 19.5 s at W32 here)."""
        if self._warm_started or not group.warm_enabled:
            return
        ranked = [s for s in self.state.slots.all() if s.rank is not None and s.alive]
        progress = [read_progress(s.heartbeat_file) for s in ranked]
        if ranked and all(p is not None for p in progress):
            self._warm_started = True
            threading.Thread(target=group.start_server, name="ckptless-warm", daemon=True).start()

    def _start_metrics(self, stack: ExitStack) -> None:
        if self.cfg.metrics_port is None:
            return
        mx = self.state.metrics = MetricsExporter(job_id=self.cfg.run_id, node_id=self.node_id)
        port = mx.start(port=self.cfg.metrics_port, host="0.0.0.0")
        stack.callback(mx.stop)
        print(f"ckptless-run: metrics at http://{self.state.host}:{port}/metrics", file=sys.stderr, flush=True)

    def _update_metrics(self) -> None:
        """Telemetry never ends a job: whatever reading the gauges' inputs raises is logged, not raised."""
        st = self.state
        if st.metrics is None:
            return
        try:
            m = self._driver.node.membership if self._driver is not None else None
            update_node_metrics(st.metrics, st.slots.all(), m, st.incident_t, st.published_t)
        except Exception as exc:  # noqa: BLE001 - a gauge must not fail the agent loop
            log.warning("metrics not updated: %s", exc)

    def _prepare_shm(self, stack: ExitStack) -> None:
        """Node-local replicas: clear files of dead jobs, own this job's, remove them at the end."""
        d = self.cfg.shm_dir
        if not d:
            return
        from ckptless.mirror import cleanup_stale, finish_job, register_owner

        os.makedirs(d, exist_ok=True)
        cleanup_stale(d)
        register_owner(d, self.cfg.run_id, node=self.node_id)
        stack.callback(lambda: finish_job(d, self.cfg.run_id, self.node_id))

    def _without_recovery(self, world_size: int) -> None:
        """World size 1 (nothing to mirror to) or --replicas 0: a failure ends the job, like torchrun."""
        if self.state.recovery:
            log.warning("world size %d: there is no peer to mirror to; recovery is off (a failure ends the job, "
                        "like torchrun --max-restarts 0)", world_size)
        self.state.recovery = False
        if self._leader is not None:
            self._leader.stop()
            self._leader = None

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
        cfg, st = self.cfg, self.state
        assert st.client is not None and st.session is not None
        layout = WorkerLayout(
            node_rank=result.node_rank, nnodes=result.nnodes, nproc_per_node=max(cfg.nproc_per_node, 1),
            rank_offset=result.rank_offset, world_size=result.world_size,
            master_addr=result.master.host, master_port=result.master.store_port,
            run_id=cfg.run_id, role=cfg.role, restart_count=0, max_restarts=cfg.max_restarts,
            virtual_local_rank=cfg.virtual_local_rank, signals_to_handle=",".join(cfg.signals_to_handle),
        )
        common = ckptless_env_from_config(cfg, etcd_endpoint=",".join(etcd_config.endpoints), node_id=self.node_id,
                                          generation=0, recovery=st.recovery)
        if st.relay is not None:
            common["CKPTLESS_CONTROL_RELAY"] = st.relay.path
        parent = dict(environment.environ())
        if cfg.spares:
            # A spare's rank reads are watched from its script's first line (a read before ckptless.init()
            # went unseen: issue 35). Every worker here gets the same PYTHONPATH, so a respawn still
            # matches the fork server's start-up environment and is forked warm.
            parent["PYTHONPATH"] = spare_site.pythonpath(parent.get("PYTHONPATH"))
        if st.slots.gpus == 0 and environment.current().cuda_backend is None:
            # A node that offers no GPU (a CPU host, or CKPTLESS_NODE_GPUS=0 on a GPU host): its workers make
            # no CUDA context and no NCCL communicator (ckptless/worker/device.py), whatever torch can see.
            common["CKPTLESS_CUDA_BACKEND"] = "none"
        # ckptless.job always (a respawn's script imports it first thing: 0.3 s here), then the user's list
        # ("-name" there drops a default: launcher/forkserver_program.py)
        preload = ",".join(m for m in ("ckptless.job", environment.current().preload) if m)
        envs = []
        standby = st.spares.standby_ranks(result.world_size, cfg.spares, prefer=self._orphaned_ranks())
        standby_of: dict[int, int | None] = {}  # a spare's local rank -> the rank it pre-builds as
        gpu_of = devices.initial_gpus(st.slots.gpus, cfg.nproc_per_node, cfg.spares)
        for lr in range(cfg.nproc_per_node + cfg.spares):
            spare = lr >= cfg.nproc_per_node
            worker_id = f"{self.node_id}/spare{lr - cfg.nproc_per_node}" if spare else f"{self.node_id}/w{lr}"
            hb = st.heartbeat_path(lr)
            extra = dict(common, CKPTLESS_WORKER_ID=worker_id, CKPTLESS_HEARTBEAT_FILE=hb,
                         CKPTLESS_EXIT_FILE=st.exit_path(lr), CKPTLESS_ROLE="spare" if spare else "member")
            extra.setdefault("CKPTLESS_PRELOAD", preload)
            env = worker_env(layout, min(lr, max(cfg.nproc_per_node, 1) - 1), parent, extra)
            if spare:  # the same spare env a --spare-refill spare gets (launcher/refill.py)
                sb = standby[lr - cfg.nproc_per_node] if standby and cfg.spare_prebuild else None
                standby_of[lr] = sb
                env.update(refill.spare_env(worker_id, hb, st.exit_path(lr), sb, st.spare_device_env(lr, gpu_of[lr])))
            envs.append(env)
            st.slots.add(Slot(lr, worker_id, None if spare else result.rank_offset + lr, hb, device=gpu_of[lr]))
        n = len(envs)
        redirects = tuple(cfg.redirects) + (Std.NONE,) * (n - len(cfg.redirects))
        tee = tuple(cfg.tee) + (Std.NONE,) * (n - len(cfg.tee))
        # Warm respawns (a fork server with torch imported) only where a respawn can happen.
        group = WorkerGroup([build_command(cfg)] * n, envs, on_exit=lambda ex: record_exit(st, ex),
                            log_dir=cfg.log_dir, redirects=redirects, tee=tee,
                            warm=cfg.warm_respawn and st.recovery, role=cfg.role)
        st.group = group
        st.feed(Spawned())  # from now on a membership moves this node's slots
        group.start(start_server=False)  # the fork server starts once our workers train (see _maybe_warm)
        for slot in st.slots.all():
            if slot.rank is None:  # a warm spare: in the pool, on our lease (gone with this node)
                st.spares.offer(slot.worker_id, standby_of[slot.local_rank], st.session.lease_id)
        if cfg.nproc_per_node == 0 and group.warm_enabled:  # nothing trains here: warm it now
            self._warm_started = True
            threading.Thread(target=group.start_server, name="ckptless-warm", daemon=True).start()
        return group
