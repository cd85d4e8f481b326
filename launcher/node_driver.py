"""The node agent's machine, driven: events in from the agent's threads, one at a time; its actions carried out.

Why a driver of its own: the machine (``launcher/node_machine.py``) is pure, and
the agent's facts arrive on three threads (the etcd watch: memberships, the
status, incidents; the reaper: exits; the main loop: ticks, the lease, a stop
signal). The driver feeds them to the machine under one lock, reading the slot
table as the event's facts under that lock, and applies the slot table writes
the step asks for before it lets go: a decision and the writes it implies are
one step, whichever thread fed it. Everything else an action does (a signal,
a respawn thread, an etcd write, a line) runs after the lock is released, in
the order the machine gave, on the thread that fed the event.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ckptless.coordinator import Compare, Put
from ckptless.errors import CkptlessError, CoordinatorError
from ckptless.launcher import refill, respawn
from ckptless.launcher.node_machine import (
    Action, Assign, Event, Exit, Kill, Log, Node, NodeConfig, NoteGeneration, NoteIncident, Reexec, RefillWaitsForGpu,
    RemoveDeadShm, Say, SendStatus, SpareDeferred, StartRespawn, StartSpare, Tick, TouchHeartbeat, step, wants_exits,
    wants_progress)
from ckptless.launcher.node_state import NodeState
from ckptless.launcher.slots import Slot
from ckptless.recovery import ExitRecord, JobStatus
from ckptless.worker import read_progress

log = logging.getLogger("ckptless.agent")


class NodeDriver:
    def __init__(self, st: NodeState, cfg: NodeConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._st = st
        self._clock = clock
        self._lock = threading.Lock()
        self._node = Node(cfg)

    @property
    def node(self) -> Node:
        """The machine's state now (a frozen record: read it whole, from any thread)."""
        return self._node

    def feed(self, event: Event | Callable[[tuple[Slot, ...]], Event]) -> Node:
        """Step the machine with ``event`` (or the event made from the slot table, read under the lock) and
        carry out its actions; the machine's state after the step."""
        with self._lock:
            ev = event(tuple(self._st.slots.all())) if callable(event) else event
            node, actions = step(self._node, ev, self._clock())
            self._node = node
            later = []
            for a in actions:
                if isinstance(a, Assign):
                    self._st.slots.assign(a.local_rank, a.rank)
                else:
                    later.append(a)
        for a in later:
            self._run(a)
        return node

    def tick(self) -> Node:
        """A turn of the main loop: the machine decides whether a spare is refilled and whether this agent
        is done. The job's exit records (one etcd read, a short deadline) and this node's heartbeat records
        are read only when the decisions need them."""
        st, node = self._st, self._node
        exits = self._read_exits() if wants_exits(node, st.slots.all()) else None
        progress: dict[str, dict[str, Any]] = {}
        if wants_progress(node):
            for s in st.slots.all():
                doc = read_progress(s.heartbeat_file) if s.rank is not None and s.alive else None
                if doc is not None:
                    progress[s.heartbeat_file] = doc
        gpu_free = st.slots.gpu_free()
        return self.feed(lambda slots: Tick(slots, exits, progress, gpu_free))

    def _read_exits(self) -> tuple[ExitRecord, ...] | None:
        st = self._st
        if st.client is None:
            return None
        try:
            # A poll of the main loop: a short deadline, so an etcd that is gone does not hold the loop
            # (and the lease renewal that notices the outage) for the client's whole call deadline.
            kvs, _ = st.client.get_prefix(st.keyspace.exits_prefix, timeout_s=2.0)
        except CoordinatorError:
            return None
        out = []
        for kv in kvs:
            try:
                out.append(ExitRecord.from_json(kv.value))
            except CkptlessError:
                continue
        return tuple(out)

    # --- the actions ------------------------------------------------------------------------------------
    def _run(self, a: Action) -> None:
        st = self._st
        if isinstance(a, Kill):
            getattr(log, a.level)("%s", a.why)
            if a.teardown_pid is not None:  # before the signal: its exit is recorded with its declared code
                st.killed_in_teardown.add(a.teardown_pid)
            if st.group is not None:
                st.group.send_signal(a.local_rank, signal.SIGKILL)
        elif isinstance(a, TouchHeartbeat):
            try:
                os.utime(a.heartbeat_file)
            except FileNotFoundError:
                pass
        elif isinstance(a, StartSpare):
            if st.group is not None and not refill.start_spare(st, st.group, a):
                self.feed(SpareDeferred(a.worker_id))
        elif isinstance(a, RefillWaitsForGpu):
            log.warning("spare refill waits: none of this node's %d GPUs is free and good (failed: %s)",
                        st.slots.gpus, sorted(st.slots.bad_gpus()) or "none")
        elif isinstance(a, StartRespawn):
            group = st.group
            if group is not None:  # off the watch and reaper threads: a cold start takes a while
                threading.Thread(target=respawn.start, args=(st, group, a.local_rank, a.assignment, a.generation),
                                 name="ckptless-respawn", daemon=True).start()
        elif isinstance(a, Log):
            getattr(log, a.level)("%s", a.message)
        elif isinstance(a, Reexec):
            respawn.reexec(st, a.local_rank, a.worker_id, a.rank, a.generation)
        elif isinstance(a, NoteGeneration):
            st.published_t.setdefault(a.generation, time.monotonic())
            if st.metrics is not None:
                st.metrics.set_generation(a.generation)
                st.metrics.set_replacement_waiting(0.0)  # a new generation: nothing waits any more
        elif isinstance(a, NoteIncident):
            if a.first:
                st.incident_t[a.generation] = time.monotonic()
                if st.metrics is not None:
                    st.metrics.record_incident()
            if a.waiting_since is not None and st.metrics is not None:
                st.metrics.set_replacement_waiting(a.waiting_since)
        elif isinstance(a, RemoveDeadShm):
            if st.cfg.shm_dir:
                from ckptless.mirror import remove_dead_groups

                remove_dead_groups(st.cfg.shm_dir, st.cfg.run_id)
        elif isinstance(a, SendStatus):
            send_status(st, a.status)
        elif isinstance(a, Say):
            print(a.text, file=sys.stderr, flush=True)
        elif isinstance(a, Exit):
            pass  # the agent's loop reads ``node.exit_code`` and tears down
        else:  # pragma: no cover - the union is closed
            raise TypeError(f"not a node action: {a!r}")


def send_status(st: NodeState, status: JobStatus) -> None:
    """Record the job's end in etcd (the first writer wins)."""
    try:
        assert st.client is not None
        st.client.txn([Compare(st.keyspace.status, "create", "==", 0)],
                      [Put(st.keyspace.status, status.to_json())])
    except CoordinatorError as exc:
        log.error("could not record the job's end in etcd: %s", exc)
