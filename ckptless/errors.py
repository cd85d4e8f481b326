"""One typed error tree for everything ckptless raises.

Why one tree: callers (the launcher, the job loop, user code) need to tell
"retry later" from "your input is wrong" from "data is corrupt" without
string matching, and every boundary (etcd client, torch.distributed, disk)
translates foreign exceptions into these with ``raise ... from exc`` so the
original cause stays attached.
"""

from __future__ import annotations


class CkptlessError(Exception):
    """Root of every error ckptless raises on purpose."""


# --- input -------------------------------------------------------------------
class ConfigError(CkptlessError, ValueError):
    """Invalid configuration or command-line input.

    Always names the offending field and value so one line is enough to fix it.
    """

    def __init__(self, field: str, value: object, reason: str) -> None:
        self.field = field
        self.value = value
        self.reason = reason
        super().__init__(f"invalid {field}={value!r}: {reason}")


class ConfigMismatch(ConfigError):
    """An agent started with other job-wide settings than its job's (``--replicas``, the script, ...).

    ``diffs``: ``(setting, the job's value, this agent's value)`` for each; the first is the error's
    field. ``opener`` names the agent whose settings the round holds (the one that opened it, node id
    and host): when the agent started wrong came first, the healthy ones are the refused ones, and a
    line that called the other side "the job" would send the user to the wrong node (issue 35).
    """

    def __init__(self, diffs: list[tuple[str, object, object]], opener: str = "") -> None:
        who = f"the agent that opened the round ({opener})" if opener else "the agent that opened the round"
        named = "; ".join(f"{k}: {who if i == 0 else 'that agent'} uses {job!r}, this agent {mine!r}"
                          for i, (k, job, mine) in enumerate(diffs))
        reason = ("every agent of a job must be started with the same job-wide settings "
                  '(docs/launcher.md, "Settings every agent must agree on"): stop whichever was started wrong')
        self.field, self.value, self.reason, self.diffs, self.opener = diffs[0][0], diffs[0][2], reason, diffs, opener
        CkptlessError.__init__(self, f"this agent disagrees with its job's rendezvous round on {named} ({reason})")


class OtherRunSettings(ConfigError):
    """An agent of a job id whose last run has ended, started with other job-wide settings than that run.

    It is no late agent of that run (a scheduler's replacement runs the job's own command): another job
    reusing the id (with an external etcd, or after editing the script). Refused rather than told "the
    job has ended", which exited 0 without training a thing (issue 35).
    """

    def __init__(self, job_id: str, outcome: str, diffs: list[tuple[str, object, object]]) -> None:
        named = "; ".join(f"{k}: the run used {job!r}, this agent {mine!r}" for k, job, mine in diffs)
        self.field, self.value, self.diffs = diffs[0][0], diffs[0][2], diffs
        self.reason = f"this --rdzv-id belongs to an ended run with other settings ({named}): use a new --rdzv-id"
        CkptlessError.__init__(self, f"job {job_id!r} ended before ({outcome}); {self.reason}")


# --- coordination (etcd) -----------------------------------------------------
class CoordinatorError(CkptlessError):
    """Anything that went wrong talking to the coordination store."""


class CoordinatorUnavailable(CoordinatorError):
    """etcd could not be reached before the deadline (retryable)."""


class CoordinatorTimeout(CoordinatorUnavailable):
    """An etcd call or a wait on etcd ran past its deadline."""


class CoordinatorAuthError(CoordinatorError):
    """etcd refused our credentials or TLS setup."""


class FencingError(CoordinatorError):
    """A fenced transaction lost: someone else changed the guarded key first.

    Never retried blindly: the caller must re-read state and re-decide.
    """


class SessionExpired(CoordinatorError):
    """Our lease is gone; everything attached to it has been deleted by etcd."""


class NotLeader(CoordinatorError):
    """An operation that only the elected leader may do was tried by a non-leader."""


class EtcdServerError(CoordinatorError):
    """The embedded etcd server failed to start or stopped unexpectedly."""


# --- rendezvous / launcher ---------------------------------------------------
class RendezvousError(CkptlessError):
    """Nodes could not form (or re-form) a job."""


class RendezvousTimeout(RendezvousError):
    """Not enough nodes joined before the rendezvous deadline. ``seen``: how many did, in words."""

    def __init__(self, message: str, seen: str = "") -> None:
        super().__init__(message)
        self.seen = seen


class RendezvousClosed(RendezvousError):
    """The job's rendezvous was closed; no new nodes are admitted."""


class RendezvousLate(RendezvousClosed):
    """This node arrived after the job formed (or beyond --nnodes' maximum): it may serve as spares."""


class JobAlreadyEnded(RendezvousClosed):
    """The job this agent would join has already ended (its ``status`` record): nothing to join.

    Carries the job's outcome: the launcher exits with ``exit_code`` (0 for a job that succeeded, 1 for
    one that failed: what the job's own agents exited with), after one line saying so. (Not the worker
    state machine's ``JobEnded`` event, ``ckptless/worker/machine.py``: that one is a running job's end.)
    """

    def __init__(self, message: str, succeeded: bool) -> None:
        super().__init__(message)
        self.succeeded = succeeded

    @property
    def exit_code(self) -> int:
        return 0 if self.succeeded else 1


class StaleGeneration(CkptlessError):
    """A message or record belongs to an older generation (or another job)."""


class WorkerError(CkptlessError):
    """A worker process failed to start or exited abnormally."""


# --- state and mirroring -----------------------------------------------------
class StateError(CkptlessError):
    """Capture or restore of training state failed."""


class ManifestError(StateError):
    """A manifest is malformed, of an unknown format version, or mismatched."""


class IntegrityError(StateError):
    """Bytes failed checksum verification (a corrupt replica or transfer)."""


class NodeCopyError(IntegrityError):
    """A node-local copy the plan had this worker adopt (R11) is gone, differs from the plan, or no longer
    checks. ``key`` = (node, holder, owner, version) names it: the worker's next report says so, and the
    leader never plans with it again (else every re-plan would pick it anew)."""

    def __init__(self, key: tuple[str, int, int, int], message: str) -> None:
        self.key = key
        super().__init__(message)


class SilentDataCorruption(IntegrityError):
    """Replicas that must hold the same state bitwise do not (``ckptless.mirror.replica_check``).

    ``replace``: this rank is the odd one of a local majority and the job's policy is to replace it
    (it leaves as a failed device); otherwise the job stops with this error."""

    def __init__(self, message: str, replace: bool = False) -> None:
        super().__init__(message)
        self.replace = replace


class MirrorError(CkptlessError):
    """Peer mirroring failed (transport, placement or peer store)."""


class TransportError(MirrorError):
    """A collective or point-to-point transfer failed or timed out."""


class CollectiveError(TransportError, RuntimeError):
    """A collective or point-to-point operation of the training groups failed: a peer died, the
    network broke, or the generation was torn down. Raised at the process-group boundary
    (``ckptless.worker.groups``), so a failure is classified by where it arose, never by text.
    Also a ``RuntimeError``: code that caught torch's plain errors keeps working."""


class CollectiveTimeout(CollectiveError):
    """A collective of the training groups waited its whole timeout and failed: a peer never entered
    it. Told apart from a collective ended by an abort (which fails at once) by the time it waited,
    at the process-group boundary. A fault, recovered like any other; reported to the leader as a
    timeout (``ReportRecord.timed_out``), which is what :class:`CollectivesDiverged` counts."""


class DeviceTimeout(TransportError):
    """The GPU did not finish a copy or stream before its deadline (a hung device, or a collective
    nobody aborted): a fault, the rank is recovered, never a wait without end."""


class PeerFailure(TransportError):
    """Another rank of this generation failed, as the coordinator says (an incident was opened)."""


class PlacementError(MirrorError):
    """No valid placement exists for the requested world, K and node layout."""


# --- recovery ---------------------------------------------------------------
class RecoveryError(CkptlessError):
    """A recovery could not be planned or executed."""


class CollectivesDiverged(RecoveryError):
    """Two recoveries in a row ended by a collective timeout, nobody dead, at the same resume
    version: the ranks are not running the same collectives after a resume (a framework's setup that
    depends on what a survivor remembers and a replacement does not, a collective one rank skips).
    Every further generation would wait out the same timeout, so the job ends, naming it, instead of
    looping (docs/failure-model.md, the failure table)."""


class UnrecoverableError(RecoveryError):
    """Neither peer memory nor disk holds a complete image: the job must end."""


class SnapshotError(CkptlessError):
    """A disk snapshot could not be written, verified or loaded."""


class DiskFullError(SnapshotError):
    """The snapshot directory ran out of space; nothing older was deleted."""
