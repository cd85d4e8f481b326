"""What the node agent's machine asks its driver to do: the actions :func:`ckptless.launcher.node_machine.step`
returns, each carried out by :mod:`ckptless.launcher.node_driver` (a signal to a worker, a slot table write,
a respawn, an etcd write, a line on stderr, the agent's exit).

Why a module of its own: as with the leader (``recovery/leader_actions.py``), the machine's transitions and
its vocabulary of outputs are read separately: a reader of a transition needs only the names, a reader of
the driver needs every field. Nothing here does I/O; ``node_machine`` re-exports them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

from ckptless.recovery import Assignment
from ckptless.recovery import JobStatus


@dataclass(frozen=True)
class Assign:
    """Write the slot table: the worker in ``local_rank`` runs ``rank`` now (None: its rank runs elsewhere).
    Applied under the driver's lock, with the step that decided it."""

    local_rank: int
    rank: int | None


@dataclass(frozen=True)
class Kill:
    """SIGKILL the worker in ``local_rank`` (``why``: the line logged first, at ``level``). ``teardown_pid``: it
    is stuck in its teardown after its program ended; its exit is recorded with the code its program declared
    (launcher/watchdog.py, launcher/exit_records.py)."""

    local_rank: int
    why: str
    level: Literal["warning", "error"] = "warning"
    teardown_pid: int | None = None


@dataclass(frozen=True)
class TouchHeartbeat:
    """Reset a frozen worker's heartbeat age once it is killed, so the next look does not kill it again."""

    heartbeat_file: str


@dataclass(frozen=True)
class StartSpare:
    """``--spare-refill``: start a new spare, ``worker_id``, in place of one that took a rank (launcher/refill.py:
    its standby rank read from etcd, a slot on a free good GPU, started like the node's first spare, offered on
    our lease). If etcd does not answer, the driver feeds SpareDeferred and the refill stays owed."""

    worker_id: str
    world_size: int
    store_host: str  # the current generation's store: a pre-built spare connects to it while it builds
    store_port: int


@dataclass(frozen=True)
class RefillWaitsForGpu:
    """Said once: a refill is owed and none of this node's GPUs is free and good."""


@dataclass(frozen=True)
class StartRespawn:
    """Start ``assignment``'s rank again in ``local_rank``, whose previous worker has exited (launcher/respawn.py:
    on a GPU of its own, or recorded at once as a failed start when none is left), off the feeding thread."""

    local_rank: int
    assignment: Assignment
    generation: int


@dataclass(frozen=True)
class Log:
    level: Literal["info", "warning", "error"]
    message: str


@dataclass(frozen=True)
class Reexec:
    """Start the pre-built spare in ``local_rank`` again as the rank it was given (launcher/respawn.py)."""

    local_rank: int
    worker_id: str
    rank: int
    generation: int


@dataclass(frozen=True)
class NoteGeneration:
    """Telemetry: a new generation reached this agent (its time, the generation gauge)."""

    generation: int


@dataclass(frozen=True)
class NoteIncident:
    """Telemetry: an incident record was seen (``first``: its opening), and since when the job waits for a
    replacement, if it does."""

    generation: int
    first: bool
    waiting_since: float | None


@dataclass(frozen=True)
class RemoveDeadShm:
    """A node lost on this host: its node-local replica files go now, not at the end (issue 17)."""


@dataclass(frozen=True)
class SendStatus:
    """Record the job's end in etcd (the first writer wins)."""

    status: JobStatus


@dataclass(frozen=True)
class Say:
    """One line on stderr, for the person who reads this agent's output."""

    text: str


@dataclass(frozen=True)
class Exit:
    """This agent is done: leave with ``code`` (the driver stops its loop; the agent tears down)."""

    code: int


Action = Union[Assign, Kill, TouchHeartbeat, StartSpare, RefillWaitsForGpu, StartRespawn, Log, Reexec, NoteGeneration,
               NoteIncident, RemoveDeadShm, SendStatus, Say, Exit]
