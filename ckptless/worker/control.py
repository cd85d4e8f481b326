"""A worker's control-plane handle: report facts, learn the next generation, see the job end.

Why workers talk to etcd at all: only at the edges of a recovery (never per
step). One watch keeps three local facts fresh -- which generations have an
open incident, the newest membership's generation, and whether the job ended
-- so the training loop checks a flag per step, not etcd. The watch covers
the keyspace's ``job/`` only (generation, membership, incidents, status):
not the other ranks' reports, ready marks or exit records, which only the
leader reads, so a worker receives O(1) events per incident whatever W is
(it received every rank's writes, about 25 W + 1.8 W^2 events per incident
in all, before: docs/scale.md). Credentials come from the same ``CKPTLESS_ETCD_*`` variables the agent
uses (workers inherit them), so a job on an authenticated etcd works.

Under ``ckptless-run`` the watch is the agent's: the worker subscribes to its
node's control relay (``coordinator/relay_server.py``: one etcd watcher per
node instead of per rank, the membership sent by etcd once per node), given
by ``CKPTLESS_CONTROL_RELAY``. Without one (a script started another way), or
when the relay's stream ends (the agent stopped, died, or dropped a worker that
did not read), the worker watches ``job/`` itself and reads every key of it
once, so nothing published in between is missed. Its writes (reports, ready
marks, the ported mark) go through the relay too: the agent puts what its
workers sent together in one etcd transaction (``coordinator/relay_writer.py``),
so a relayed worker opens no etcd connection at all and etcd serves O(nodes)
clients and about one request per node per recovery phase. Its own etcd
client is made only when it needs one: no relay, a relay that ended, or one
that did not answer a write within ``RELAY_WRITE_TIMEOUT_S``.

etcd outages: a healthy worker never needs etcd to train. When it must write
(a report, a ready mark), it retries until ``outage_timeout_s`` and only then
raises :class:`CoordinatorUnavailable`: recovery needs the coordinator, and
waiting a bounded time for it to return beats giving up at once.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ckptless.coordinator import EtcdClient, WatchEvent
from ckptless.coordinator import EtcdConfig
from ckptless.coordinator import Keyspace
from ckptless.coordinator import RelaySubscription, RelayWriteTimeout
from ckptless.coordinator import RelayClosed
from ckptless.errors import CkptlessError, CoordinatorError, CoordinatorUnavailable, RecoveryError
from ckptless.recovery import WorkerReport
from ckptless.recovery import JobStatus, report_record_to_json
from ckptless.recovery import Membership, membership_from_json
from ckptless.worker import abort

T = TypeVar("T")
log = logging.getLogger(__name__)
REREAD_S = 5.0  # wait_membership reads etcd itself this often while its own watch has nothing newer
# A write the relay did not answer in this time goes to etcd directly (the agent's transaction has
# the etcd client's call deadline, 10 s by default, to ride out an etcd restart).
RELAY_WRITE_TIMEOUT_S = 12.0


class JobEndedError(RecoveryError):
    """The coordinator ended the job (a user error elsewhere, or an unrecoverable loss)."""

    def __init__(self, status: JobStatus) -> None:
        self.status = status
        super().__init__(f"the job was ended by its coordinator: {status.reason}")


class WorkerControl:
    def __init__(self, endpoint: str, job_id: str, worker_id: str, outage_timeout_s: float = 300.0,
                 relay_path: str | None = None) -> None:
        self.keyspace = Keyspace(job_id)
        self.worker_id = worker_id
        self.outage_timeout_s = outage_timeout_s
        self._endpoint = endpoint
        self._client: EtcdClient | None = None  # made on first need (a relayed worker may never need it)
        self._client_lock = threading.Lock()
        self._incidents: set[int] = set()
        self._grows: set[int] = set()  # generations with fewer ranks the leader asked to grow back
        self._newest_generation = -1
        self._status: JobStatus | None = None
        self._membership_raw: bytes | None = None  # the newest membership the watch delivered
        self._membership_rev = -1  # its etcd revision (a resync never rolls it back)
        self._decoded: tuple[bytes | None, Membership | None] = (None, None)
        self._raw_lock = threading.Lock()
        self._changed = threading.Event()
        self.events_seen = 0  # events this worker's watch or relay delivered (docs/scale.md, bench/scale.py)
        self._closing = False
        self._switch_lock = threading.Lock()
        self._watch: Any = None
        self._relay: RelaySubscription | None = None
        self._relay_gone = threading.Event()
        self._stop = threading.Event()
        if relay_path:
            try:
                self._relay = RelaySubscription(relay_path, self._on_events, self._relay_lost)
            except (OSError, CkptlessError) as exc:
                log.warning("control relay %s unreachable (%s): watching etcd directly", relay_path, exc)
        if self._relay is None:
            self._watch = self.client.watch_prefix(self.keyspace.job_prefix, self._on_events)
            self._read_initial()

    @property
    def client(self) -> EtcdClient:
        """This worker's own etcd client, connected on first use."""
        with self._client_lock:
            if self._client is None:
                self._client = EtcdClient(EtcdConfig.from_env(self._endpoint))
            return self._client

    @property
    def has_own_client(self) -> bool:
        """True once this worker connected to etcd itself (docs/scale.md: a relayed worker does not)."""
        return self._client is not None

    @property
    def relayed(self) -> bool:
        """True while this worker learns from its node's relay (not from a watch of its own)."""
        return self._relay is not None and not self._relay_gone.is_set()

    def _relay_lost(self, exc: BaseException) -> None:
        """The relay's stream ended: watch etcd from now on, and read every ``job/`` key once (what was
        published while no one was listening). Runs on the subscription's thread, which has nothing else
        to do: it retries until etcd answers (a worker's first connection may meet an etcd outage)."""
        self._relay_gone.set()
        log.warning("control relay lost (%s): watching etcd directly", exc)
        while True:
            with self._switch_lock:
                if self._closing or self._watch is not None:
                    return
                try:
                    self._watch = self.client.watch_prefix(self.keyspace.job_prefix, self._on_events)
                    break
                except CoordinatorError as err:
                    log.warning("cannot watch etcd yet (%s); retrying", err)
            self._stop.wait(1.0)
        try:
            kvs, _ = self.client.get_prefix(self.keyspace.job_prefix)
        except CoordinatorError:
            return  # the watch delivers what changes next; wait_membership re-reads every REREAD_S
        self._on_events([kv.as_put() for kv in kvs])

    def _read_initial(self) -> None:
        """The watch only reports changes: what was already there is read once."""
        self._status = self._read_status()
        kv = self.client.get(self.keyspace.generation)
        if kv is not None:
            self._newest_generation = int(json.loads(kv.value)["generation"])
        kv = self.client.get(self.keyspace.membership)
        if kv is not None:
            with self._raw_lock:
                if kv.mod_revision > self._membership_rev:  # the watch may already have delivered a newer one
                    self._membership_raw, self._membership_rev = kv.value, kv.mod_revision

    def _read_status(self) -> JobStatus | None:
        kv = self.client.get(self.keyspace.status)
        if kv is None:
            return None
        try:
            return JobStatus.from_json(kv.value)
        except CkptlessError:
            return JobStatus("failed", "the job's status record is malformed")

    def _on_events(self, events: list[WatchEvent]) -> None:
        ks = self.keyspace
        self.events_seen += len(events)
        for e in events:
            if e.kind != "put":
                continue
            failed = ks.incident_generation(e.key)
            if failed is not None:
                self._incidents.add(failed)
                # The leader declared the generation failed: end its connections and abort its
                # communicators now, off the training thread, so a collective blocked on healthy peers
                # raises at once (not hop by hop, not at the collective timeout where a peer's loader
                # workers hold its sockets, and never, for NCCL, until torch's watchdog kills us).
                abort.request(failed, "the coordinator declared it failed")
            elif ks.grow_generation(e.key) is not None:
                self._grows.add(ks.grow_generation(e.key))  # type: ignore[arg-type]
            elif e.key == ks.membership:
                with self._raw_lock:  # the newest revision wins (a resync after a lost relay may repeat one)
                    if e.mod_revision >= self._membership_rev:
                        self._membership_raw, self._membership_rev = e.value, e.mod_revision
            elif e.key == ks.generation:
                try:
                    self._newest_generation = max(self._newest_generation, int(json.loads(e.value)["generation"]))
                except (ValueError, KeyError, TypeError):
                    pass
            elif e.key == ks.status:
                try:
                    self._status = JobStatus.from_json(e.value)
                except CkptlessError:
                    self._status = JobStatus("failed", "the job's status record is malformed")
        self._changed.set()

    # --- local facts (no etcd round trip) -------------------------------------------------------
    def incident(self, generation: int) -> bool:
        """True once the leader declared ``generation`` failed."""
        return generation in self._incidents

    def grow_requested(self, generation: int) -> bool:
        """True once the leader asked generation ``generation`` (fewer ranks) to hand its hosted ranks back."""
        return generation in self._grows

    def superseded(self, generation: int) -> bool:
        """A newer generation than ``generation`` was published."""
        return self._newest_generation > generation

    @property
    def ended(self) -> JobStatus | None:
        return self._status

    def check_ended(self) -> None:
        st = self._status
        if st is not None and st.state == "failed":
            raise JobEndedError(st)

    # --- writes, tolerant of a bounded etcd outage ---------------------------------------------------
    def _persist(self, what: str, fn: Callable[[], T]) -> T:
        deadline = time.monotonic() + self.outage_timeout_s
        said = False
        while True:
            try:
                return fn()
            except CoordinatorUnavailable as exc:
                if time.monotonic() >= deadline:
                    raise CoordinatorUnavailable(f"{what}: etcd unreachable for {self.outage_timeout_s:.0f}s") from exc
                if not said:  # a write that waits must say so once: a silent retry reads as a hang
                    said = True
                    log.warning("%s: etcd unreachable (%s); retrying for up to %.0fs", what, exc, self.outage_timeout_s)
                self._changed.wait(1.0)

    def _put(self, key: str, value: bytes | str) -> None:
        """Through the node's relay while there is one (CoordinatorUnavailable when the agent could not
        reach etcd: ``_persist`` retries); directly when it is gone or does not answer."""
        relay = self._relay
        if relay is not None and self.relayed:
            data = value.encode() if isinstance(value, str) else value
            try:
                relay.put(key, data, RELAY_WRITE_TIMEOUT_S)
                return
            except (RelayClosed, RelayWriteTimeout) as exc:
                log.warning("control relay took no write of %s (%s): writing to etcd directly", key, exc)
        self.client.put(key, value)

    def report(self, generation: int, rank: int, report: WorkerReport, reason: str,
               bad_snapshot: int | None = None, bad_copies: tuple[tuple[str, int, int, int], ...] = (),
               timed_out: bool = False) -> None:
        payload = report_record_to_json(report, reason, bad_snapshot, bad_copies, timed_out)
        self._persist(f"report for generation {generation}", lambda: self._put(self.keyspace.facts(generation, rank), payload))

    def mark_ported(self) -> None:
        """This job's script uses ckptless: a failure is recoverable (one put per worker, at init)."""
        self._persist("ported mark", lambda: self._put(self.keyspace.ported, self.worker_id))

    def mark_ready(self, generation: int, rank: int) -> None:
        payload = json.dumps({"worker_id": self.worker_id, "t": time.time()})
        self._persist(f"ready mark of generation {generation}", lambda: self._put(self.keyspace.ready(generation, rank), payload))

    # --- memberships -----------------------------------------------------------------------------------
    def membership(self) -> Membership | None:
        kv = self._persist("membership read", lambda: self.client.get(self.keyspace.membership))
        return None if kv is None else membership_from_json(kv.value)

    def _delivered(self) -> Membership | None:
        """The newest membership the watch (or the first read) delivered, decoded once."""
        raw = self._membership_raw
        if raw is None:
            return None
        if self._decoded[0] is not raw:
            try:
                self._decoded = (raw, membership_from_json(raw))
            except RecoveryError:
                self._decoded = (raw, None)
        return self._decoded[1]

    def wait_membership(self, after: int, deadline: float) -> Membership | None:
        """The newest membership newer than ``after`` that includes us, or the one that excludes us.

        Returns None at the deadline; raises :class:`JobEndedError` if the job
        ended. While joining (``after == -1``) a membership without us is
        skipped: a spare waits until the coordinator assigns it a rank.

        The record comes from the watch, which already delivered it: reading
        it again would double the bytes every worker pulls from etcd per
        incident (O(nodes) each, docs/scale.md). etcd is read again only every
        ``REREAD_S`` while nothing newer arrived, in case the worker's own watch
        is behind (it re-creates itself after an etcd restart); never while the
        relay serves it (the agent's watch catches up by revision, and a
        relayed worker keeps no etcd connection: a spare waits for hours).
        """
        next_read = time.monotonic() + REREAD_S
        while True:
            self._changed.clear()
            self.check_ended()
            m = self._delivered()
            if (m is None or m.generation <= after) and time.monotonic() >= next_read and not self.relayed:
                next_read = time.monotonic() + REREAD_S
                try:
                    m = self.membership()
                except CoordinatorError:
                    m = None
            if m is not None and m.generation > after:
                if m.rank_of(self.worker_id) is not None or after >= 0:
                    return m
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._changed.wait(min(left, 0.5))

    def close(self) -> None:
        self._stop.set()
        with self._switch_lock:
            self._closing = True
        if self._relay is not None:
            self._relay.cancel()
        if self._watch is not None:
            self._watch.cancel()
        with self._client_lock:
            if self._client is not None:
                self._client.close()
