"""The node agent behind ``ckptless-run``: one per node, long-lived.

Why a separate long-lived agent (as in torchelastic): the agent survives its
workers, so it can report their exits to etcd within milliseconds, host the
job's TCPStore (a store hosted by a worker dies with it), and, in later
stages, admit spares and respawn failed workers. It never imports training
code.

Lifecycle: connect to etcd (embedded when no endpoint) -> open a lease session
-> host a TCPStore -> rendezvous (node rank) -> spawn workers -> record each
exit in etcd -> on failure anywhere, stop local workers -> finish barrier ->
revoke the lease (no stale keys) -> stop embedded etcd.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
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
from ckptless.errors import CkptlessError, CoordinatorError
from ckptless.launcher.args import LaunchConfig
from ckptless.launcher.worker_env import WorkerLayout, build_command, worker_env
from ckptless.launcher.workers import WorkerExit, WorkerGroup

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
        self._failure = threading.Event()
        self._exits: dict[int, WorkerExit] = {}
        self._exits_lock = threading.Lock()
        self._stop_signal: int | None = None
        self._client: EtcdClient | None = None
        self._result: RendezvousResult | None = None

    # --- signals -------------------------------------------------------------
    def _install_signal_handlers(self, group_ref: list[WorkerGroup]) -> None:
        def handler(signum: int, _frame: FrameType | None) -> None:
            self._stop_signal = signum
            for group in group_ref:
                group.signal_all(signum)
            self._failure.set()

        for name in self.cfg.signals_to_handle:
            sig = getattr(signal, name, None)
            if isinstance(sig, signal.Signals) and threading.current_thread() is threading.main_thread():
                signal.signal(sig, handler)

    # --- exit records ----------------------------------------------------------
    def _record_exit(self, ex: WorkerExit) -> None:
        """Called by the reaper the moment a worker is reaped: into etcd first, then decide."""
        assert self._client is not None and self._result is not None
        rank = self._result.rank_offset + ex.local_rank
        doc = {
            "rank": rank,
            "local_rank": ex.local_rank,
            "node_id": self.node_id,
            "pid": ex.pid,
            "exitcode": ex.exitcode,
            "signal": ex.signal,
            "time": ex.wall,
            "round": self._result.round,
        }
        try:
            self._client.put(self.keyspace.worker_exit(rank), json.dumps(doc))
        except CoordinatorError:
            log.exception("could not record the exit of rank %d", rank)
        with self._exits_lock:
            self._exits[ex.local_rank] = ex
        if not ex.succeeded:
            log.error("worker rank %d (pid %d) failed: %s", rank, ex.pid, f"exitcode={ex.exitcode} signal={ex.signal}")
            self._failure.set()

    def _on_remote_exits(self, events: list[WatchEvent]) -> None:
        for ev in events:
            if ev.kind != "put":
                continue
            try:
                doc = json.loads(ev.value)
            except ValueError:
                continue
            if doc.get("node_id") != self.node_id and (doc.get("exitcode") not in (0, None) or doc.get("signal")):
                log.error("rank %s on node %s failed; stopping this node's workers", doc.get("rank"), doc.get("node_id"))
                self._failure.set()

    # --- main ----------------------------------------------------------------------
    def run(self) -> AgentOutcome:
        import torch.distributed as dist  # deferred: importing torch costs ~2 s

        cfg = self.cfg
        groups: list[WorkerGroup] = []
        self._install_signal_handlers(groups)
        with ExitStack() as stack:
            if self._etcd_config is not None:
                etcd_config = self._etcd_config
            elif cfg.rdzv_endpoint is None:
                server = EmbeddedEtcd()
                server.start()
                stack.callback(server.close)
                etcd_config = EtcdConfig((server.endpoint,))
                log.info("started embedded etcd at %s", server.endpoint)
            else:
                auth = _etcd_auth_from_env()
                etcd_config = EtcdConfig(
                    (str(cfg.rdzv_endpoint),),
                    user=auth.get("user"),
                    password=auth.get("password"),
                    ca_cert=auth.get("ca_cert"),
                    cert_key=auth.get("cert_key"),
                    cert_cert=auth.get("cert_cert"),
                )
            client = EtcdClient(etcd_config)
            stack.callback(client.close)
            self._client = client
            session = Session(client, ttl_s=cfg.lease_ttl, name=self.node_id)
            stack.callback(session.close)

            host = cfg.local_addr or (cfg.master_addr if cfg.rdzv_endpoint is None else socket.getfqdn())
            store = dist.TCPStore(host, cfg.master_port or 0, is_master=True, wait_for_workers=False, use_libuv=True)
            me = NodeInfo(self.node_id, host, cfg.nproc_per_node, int(store.port))
            rdzv = Rendezvous(client, self.keyspace, session)
            result = rdzv.join(me, cfg.min_nodes, cfg.max_nodes, timeout_s=self.rendezvous_timeout_s)
            self._result = result
            log.info(
                "node %s joined round %d as node rank %d of %d (ranks %d..%d of %d)",
                self.node_id, result.round, result.node_rank, result.nnodes,
                result.rank_offset, result.rank_offset + cfg.nproc_per_node - 1, result.world_size,
            )
            watch = client.watch_prefix(self.keyspace.exits_prefix, self._on_remote_exits)
            stack.callback(watch.cancel)

            layout = WorkerLayout(
                node_rank=result.node_rank,
                nnodes=result.nnodes,
                nproc_per_node=cfg.nproc_per_node,
                rank_offset=result.rank_offset,
                world_size=result.world_size,
                master_addr=result.master.host,
                master_port=result.master.store_port,
                run_id=cfg.run_id,
                role=cfg.role,
                restart_count=0,
                max_restarts=cfg.max_restarts,
            )
            extra = {
                "CKPTLESS_ETCD_ENDPOINT": ",".join(etcd_config.endpoints),
                "CKPTLESS_JOB_ID": cfg.run_id,
                "CKPTLESS_NODE_ID": self.node_id,
                "CKPTLESS_GENERATION": str(result.round),
                "CKPTLESS_REPLICAS": str(cfg.replicas),
                "CKPTLESS_MIRROR_EVERY": str(cfg.mirror_every),
                "CKPTLESS_PLACEMENT": cfg.placement,
            }
            if cfg.goodput_dir:
                extra["CKPTLESS_GOODPUT_DIR"] = cfg.goodput_dir
            group = WorkerGroup(
                [build_command(cfg)] * cfg.nproc_per_node,
                [worker_env(layout, local_rank, os.environ, extra) for local_rank in range(cfg.nproc_per_node)],
                on_exit=self._record_exit,
                log_dir=cfg.log_dir,
                redirects=cfg.redirects,
                tee=cfg.tee,
            )
            groups.append(group)
            stack.callback(lambda: group.stop(timeout=cfg.shutdown_timeout))
            group.start()

            while not group.wait(timeout=0.2):
                if self._failure.is_set():
                    break
                session.check()
            if self._failure.is_set() or self._stop_signal is not None:
                group.stop(timeout=cfg.shutdown_timeout)
            with self._exits_lock:
                failed = tuple(
                    result.rank_offset + lr for lr, ex in sorted(self._exits.items()) if not ex.succeeded
                )
            remote_failure = self._failure.is_set() and not failed
            code = 0
            if self._stop_signal is not None:
                code = 128 + self._stop_signal
            elif failed or remote_failure:
                code = 1
            self._finish_barrier(client, session, result, ok=code == 0)
            return AgentOutcome(code, failed)
        raise AssertionError("unreachable")

    def _finish_barrier(self, client: EtcdClient, session: Session, result: RendezvousResult, ok: bool) -> None:
        """Node rank 0 hosts the store: it must outlive every other node's workers."""
        client.put(self.keyspace.node_done(result.node_rank), "ok" if ok else "failed", lease=session.lease_id)
        if result.node_rank != 0 or not ok:
            return
        deadline = time.monotonic() + self.cfg.shutdown_timeout
        live = set(range(result.nnodes))
        while time.monotonic() < deadline:
            kvs, _ = client.get_prefix(self.keyspace.done_prefix)
            done = {int(kv.key.rsplit("/", 1)[1]) for kv in kvs}
            nodes, _ = client.get_prefix(self.keyspace.nodes_prefix)
            alive_ids = {kv.key.rsplit("/", 1)[1] for kv in nodes}
            live = {p for p in range(result.nnodes) if result.participants[p].node_id in alive_ids}
            if live <= done:
                return
            if self._failure.wait(0.05):
                return
        log.warning("finish barrier: nodes %s did not finish within %ss", sorted(live), self.cfg.shutdown_timeout)


def _etcd_auth_from_env() -> dict[str, str]:
    """TLS and auth for an external etcd, from CKPTLESS_ETCD_* variables."""
    mapping = {
        "CKPTLESS_ETCD_USER": "user",
        "CKPTLESS_ETCD_PASSWORD": "password",
        "CKPTLESS_ETCD_CA_CERT": "ca_cert",
        "CKPTLESS_ETCD_CERT_KEY": "cert_key",
        "CKPTLESS_ETCD_CERT": "cert_cert",
    }
    return {field: os.environ[var] for var, field in mapping.items() if os.environ.get(var)}


def run_agent(cfg: LaunchConfig) -> int:
    try:
        return NodeAgent(cfg).run().exit_code
    except CkptlessError as exc:
        log.error("%s", exc)
        return 1
