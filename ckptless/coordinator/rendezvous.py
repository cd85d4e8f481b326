"""Node rendezvous over etcd: agents with one job id agree on node ranks.

Why not torch's etcd rendezvous: it speaks the etcd v2 API (gone from etcd
3.4+ by default) and re-uses a shared store across rounds, which made
restarted workers read the previous round's keys here. Ours is a single JSON
record ``rdzv/state`` changed only by transactions fenced on its mod revision:

* ``joining``: agents append themselves to ``participants`` (order = node rank);
* it closes when ``max_nodes`` joined, or ``min_nodes`` joined and no new
  agent arrived for ``last_call_s``;
* ``closed``: the membership is fixed; node ranks are indices. A closed round
  whose participants' node keys are all gone (a previous run with the same id)
  is replaced by a fresh round.

A round also records the job-wide settings of the agent that opened it
(``config``: the flags every agent must agree on and the script, as the
launcher names them, ``launcher/admission.py``); every later agent, a joiner,
a late node or a spare node, is compared with it and refused in one line
naming each setting and both values: agents that disagree on, say,
``--replicas`` formed one job that hung in its first mirror round (issue 35).

The pure decisions (``decide_*``) are kept apart from the etcd I/O.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ckptless.coordinator.client import Compare, EtcdClient, Put
from ckptless.coordinator.keyspace import Keyspace
from ckptless.coordinator.session import Session
from ckptless.errors import ConfigError, ConfigMismatch, RendezvousError, RendezvousLate, RendezvousTimeout


@dataclass(frozen=True)
class NodeInfo:
    """What an agent advertises about itself."""

    node_id: str
    host: str
    nproc: int
    store_port: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> NodeInfo:
        try:
            return cls(str(doc["node_id"]), str(doc["host"]), int(doc["nproc"]), int(doc.get("store_port", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise RendezvousError(f"malformed node record {doc!r}") from exc


@dataclass(frozen=True)
class RoundState:
    round: int = 0
    state: str = "joining"
    participants: tuple[NodeInfo, ...] = ()
    min_nodes: int = 1
    max_nodes: int = 1
    # The job-wide settings of the agent that opened the round (JSON values): what every agent must agree on.
    config: Mapping[str, Any] = field(default_factory=dict)
    # Who recorded ``config`` ("node <id> on <host>"): a refusal names it, since that agent may be the one
    # started wrong (it came first) and the refused one the healthy one.
    opener: str = ""

    def to_bytes(self) -> bytes:
        doc = {
            "round": self.round,
            "state": self.state,
            "participants": [p.to_json() for p in self.participants],
            "min_nodes": self.min_nodes,
            "max_nodes": self.max_nodes,
            "config": dict(self.config),
            "opener": self.opener,
        }
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> RoundState:
        try:
            doc = json.loads(raw)
            return cls(
                round=int(doc["round"]),
                state=str(doc["state"]),
                participants=tuple(NodeInfo.from_json(p) for p in doc["participants"]),
                min_nodes=int(doc["min_nodes"]),
                max_nodes=int(doc["max_nodes"]),
                config=dict(doc.get("config") or {}),
                opener=str(doc.get("opener") or ""),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise RendezvousError(f"corrupt rendezvous record: {raw[:200]!r}") from exc

    def ids(self) -> list[str]:
        return [p.node_id for p in self.participants]

    def check(self, mine: Mapping[str, Any]) -> None:
        """Refuse an agent with job-wide settings ``mine`` unless they are the round's (:func:`check_agreement`)."""
        check_agreement(self.config, mine, self.opener)


@dataclass(frozen=True)
class RendezvousResult:
    round: int
    node_rank: int
    nnodes: int
    participants: tuple[NodeInfo, ...]
    # global rank of this node's local rank 0, and the world size
    rank_offset: int
    world_size: int
    master: NodeInfo = field(repr=False, default=NodeInfo("", "", 0))
    late: bool = False  # the node arrived after the job formed and serves as spares (launcher/joining.py)


# --- pure decisions --------------------------------------------------------
def config_disagreement(job: Mapping[str, Any], mine: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(setting, the job's value, this agent's value)`` for each setting on which they differ, in the
    job's order. A setting only one side records (an agent of another ckptless version) decides nothing."""
    return [(k, job[k], mine[k]) for k in job if k in mine and job[k] != mine[k]]


def check_agreement(job: Mapping[str, Any], mine: Mapping[str, Any], opener: str = "") -> None:
    """Refuse an agent whose job-wide settings differ from the job's: one :class:`ConfigMismatch`, one
    line, naming every setting that differs with both values and the agent whose values the job holds
    (``opener``)."""
    diffs = config_disagreement(job, mine)
    if diffs:
        raise ConfigMismatch(diffs, opener)


def opener_of(me: NodeInfo) -> str:
    return f"node {me.node_id} on {me.host}" if me.host else f"node {me.node_id}"


def decide_join(state: RoundState | None, me: NodeInfo, min_nodes: int, max_nodes: int, live_ids: set[str],
                config: Mapping[str, Any] | None = None) -> RoundState | None:
    """The record to write so that ``me`` (with job-wide settings ``config``) joins, or None when nothing
    needs writing. An agent that disagrees with the round's settings is refused (ConfigError), a late
    one too: as spares it would run with its own settings."""
    mine = dict(config or {})
    if state is None or (state.state == "closed" and not (set(state.ids()) & live_ids)):
        nxt = 0 if state is None else state.round + 1
        return RoundState(nxt, "joining", (me,), min_nodes, max_nodes, mine, opener_of(me))
    if me.node_id in state.ids():
        return None
    if state.state == "closed":
        state.check(mine)
        raise RendezvousLate(
            f"rendezvous round {state.round} is closed with {len(state.participants)} node(s); "
            "this agent arrived late"
        )
    if (state.min_nodes, state.max_nodes) != (min_nodes, max_nodes):
        raise ConfigError("nnodes", f"{min_nodes}:{max_nodes}", f"other agents of this job use {state.min_nodes}:{state.max_nodes}")
    # Drop joiners whose agents died while the round was open.
    alive = tuple(p for p in state.participants if p.node_id in live_ids)
    if not alive:  # nobody is left who was started with the round's settings: this agent's are the job's
        return RoundState(state.round, "joining", (me,), min_nodes, max_nodes, mine, opener_of(me))
    state.check(mine)
    if len(alive) >= max_nodes:
        raise RendezvousLate(f"rendezvous round {state.round} is full ({max_nodes} nodes)")
    return replace(state, participants=alive + (me,))


def decide_close(state: RoundState, live_ids: set[str], last_call_expired: bool) -> RoundState | None:
    """The closed record to write, or None when the round must stay open."""
    if state.state != "joining":
        return None
    alive = tuple(p for p in state.participants if p.node_id in live_ids)
    if len(alive) >= state.max_nodes or (len(alive) >= state.min_nodes and last_call_expired):
        return replace(state, state="closed", participants=alive)
    return None


def result_for(state: RoundState, node_id: str) -> RendezvousResult:
    ids = state.ids()
    rank = ids.index(node_id)
    offset = sum(p.nproc for p in state.participants[:rank])
    world = sum(p.nproc for p in state.participants)
    return RendezvousResult(state.round, rank, len(ids), state.participants, offset, world, state.participants[0])


# --- etcd I/O ----------------------------------------------------------------
class Rendezvous:
    def __init__(self, client: EtcdClient, keyspace: Keyspace, session: Session) -> None:
        self._client = client
        self._ks = keyspace
        self._session = session

    def register(self, me: NodeInfo) -> None:
        """Advertise this node on the session lease (deleted by etcd when we die)."""
        self._client.put(self._ks.node(me.node_id), json.dumps(me.to_json()), lease=self._session.lease_id)

    def live_node_ids(self) -> set[str]:
        kvs, _ = self._client.get_prefix(self._ks.nodes_prefix)
        return {kv.key.rsplit("/", 1)[1] for kv in kvs}

    def _read(self) -> tuple[RoundState | None, int]:
        kv = self._client.get(self._ks.rdzv_state)
        if kv is None:
            return None, 0
        return RoundState.from_bytes(kv.value), kv.mod_revision

    def _write(self, new: RoundState, mod_revision: int) -> bool:
        guard = Compare(self._ks.rdzv_state, "mod", "==", mod_revision) if mod_revision else Compare(
            self._ks.rdzv_state, "create", "==", 0
        )
        return self._client.txn([guard], [Put(self._ks.rdzv_state, new.to_bytes())]).succeeded

    def join(self, me: NodeInfo, min_nodes: int, max_nodes: int, timeout_s: float, last_call_s: float = 1.0,
             stop: threading.Event | None = None, config: Mapping[str, Any] | None = None) -> RendezvousResult:
        """Join (or rejoin) the current round and block until it closes or ``timeout_s`` passes.

        ``stop`` (set by the agent's SIGINT/SIGTERM handler) ends the wait at once with
        :class:`RendezvousError`: a launcher waiting for nodes must obey Ctrl-C. ``config``: this
        agent's job-wide settings (JSON values), compared with the round's (``decide_join``).
        """
        if not 1 <= min_nodes <= max_nodes:
            raise ConfigError("nnodes", f"{min_nodes}:{max_nodes}", "need 1 <= MIN <= MAX")
        self.register(me)
        deadline = time.monotonic() + timeout_s
        changed = threading.Event()
        # Only what the join decides on: the round and the live nodes (not the whole job's keys, which
        # every joining agent would otherwise receive: O(nodes) events each while the job forms).
        watches = [self._client.watch_prefix(p, lambda _evs: changed.set())
                   for p in (self._ks.rdzv_state, self._ks.nodes_prefix)]
        try:
            last_size = -1
            last_change = time.monotonic()
            while True:
                self._session.check()
                if stop is not None and stop.is_set():
                    raise RendezvousError(f"rendezvous for job {self._ks.job_id!r} interrupted")
                changed.clear()
                state, rev = self._read()
                live = self.live_node_ids()
                if state is not None and state.state == "closed" and me.node_id in state.ids():
                    return result_for(state, me.node_id)
                new = decide_join(state, me, min_nodes, max_nodes, live, config)
                if new is not None:
                    self._write(new, rev)
                    continue
                assert state is not None
                if len(state.participants) != last_size:
                    last_size, last_change = len(state.participants), time.monotonic()
                closed = decide_close(state, live, time.monotonic() - last_change >= last_call_s)
                if closed is not None:
                    self._write(closed, rev)
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    seen = f"{len(state.participants)} of {min_nodes}..{max_nodes} node(s) came"
                    raise RendezvousTimeout(
                        f"rendezvous for job {self._ks.job_id!r} timed out after {timeout_s}s with "
                        f"{len(state.participants)} of {min_nodes}..{max_nodes} node(s)", seen)
                # Wake on a change of the round or the nodes, or to re-check the last call.
                changed.wait(min(remaining, 0.25, max(0.05, last_call_s - (time.monotonic() - last_change))))
        finally:
            for w in watches:
                w.cancel()
