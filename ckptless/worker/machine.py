"""A worker's life as an explicit state machine: ``step(state, event, cfg) -> (state, actions)``.

Why: recovery used to run on loose flags spread over the job loop and its
recovery method, and a second failure at the wrong moment left ranks waiting
on each other. Here every state a worker can be in is named, every event it
can observe is typed, and every transition is one case of a pure function
that tests drive with a fake clock: a failure in *any* state leads back to
Leaving -> Reporting -> Awaiting, and every waiting state has a deadline and
a defined next state. The driver (:mod:`ckptless.worker.driver`) executes the
actions and turns what happened into the next event.

::

    Joining --admitted--> Forming --formed--> Restoring --restored--> Training(reprotecting)
    Forming --formed (gen 0)--> Training
    Training --re-protected--> Training --all steps--> Finishing --committed--> Finished
    Training/Finishing/Forming/Restoring --fault--> Leaving --left--> Reporting --reported--> Awaiting
    Awaiting --next generation--> Forming
    Training --user error--> Failed(user_error)          (never retried: the job fails fast)
    any --the GPU failed--> Failed(device)               (no recovery in this process: its CUDA context
                                                          is poisoned; the rank is recovered elsewhere)
    Awaiting --excluded--> Failed(fenced)   any --job ended--> Failed(job_ended)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Union

from ckptless.recovery import ErrorSummary

FailKind = Literal["user_error", "job_ended", "fenced", "internal", "device"]


@dataclass(frozen=True)
class WorkerConfig:
    """How long each waiting state may last (seconds) before its defined way out."""

    join_timeout_s: float = 600.0  # a member or replacement waiting to be admitted (a spare: much longer)
    form_timeout_s: float = 600.0  # the leader normally re-plans long before; this is a safety net
    await_timeout_s: float = 600.0  # waiting for the next generation after reporting


# --- states -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Joining:
    deadline: float


@dataclass(frozen=True)
class Forming:
    generation: int
    deadline: float
    restore: bool  # the generation was made by a recovery decision this rank must apply


@dataclass(frozen=True)
class Restoring:
    generation: int


@dataclass(frozen=True)
class Training:
    generation: int
    step: int
    reprotecting: bool = False  # the resume version is still being re-mirrored in the background


@dataclass(frozen=True)
class Finishing:
    generation: int


@dataclass(frozen=True)
class Leaving:
    generation: int
    reason: str


@dataclass(frozen=True)
class Reporting:
    generation: int
    reason: str


@dataclass(frozen=True)
class Awaiting:
    generation: int
    deadline: float


@dataclass(frozen=True)
class Finished:
    generation: int


@dataclass(frozen=True)
class Failed:
    kind: FailKind
    message: str
    error: ErrorSummary | None = None  # what the exit file records (a device failure's error)


State = Union[Joining, Forming, Restoring, Training, Finishing, Leaving, Reporting, Awaiting, Finished, Failed]


# --- events -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Started:
    now: float
    deadline_s: float | None = None  # a spare waits longer than WorkerConfig.join_timeout_s


@dataclass(frozen=True)
class MembershipSeen:
    """A membership newer than the generation we are in (or any, while joining)."""

    generation: int
    includes_me: bool
    from_decision: bool  # made by a recovery plan (survivors and replacements must apply it)
    now: float


@dataclass(frozen=True)
class Formed:
    generation: int
    start_step: int  # where training starts when there is nothing to restore (-1: the run's first step)


@dataclass(frozen=True)
class FormFailed:
    reason: str


@dataclass(frozen=True)
class Restored:
    step: int  # the step to run next


@dataclass(frozen=True)
class RestoreFailed:
    reason: str


@dataclass(frozen=True)
class Stepped:
    """The training action returned: all steps done, or the re-protection round committed."""

    step: int
    done: bool


@dataclass(frozen=True)
class Reprotected:
    step: int


@dataclass(frozen=True)
class Fault:
    """A peer failed or a collective broke (typed at the process-group/mirror boundary)."""

    reason: str


@dataclass(frozen=True)
class UserError:
    """An exception raised by the user's own code: the job fails fast."""

    summary: str
    # The exception itself, re-raised from run() (the driver keeps it; the machine decides on the summary).
    error: BaseException | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Committed:
    pass


@dataclass(frozen=True)
class Left:
    now: float


@dataclass(frozen=True)
class Reported:
    now: float


@dataclass(frozen=True)
class JobEnded:
    reason: str


@dataclass(frozen=True)
class CoordinatorLost:
    reason: str


@dataclass(frozen=True)
class TimedOut:
    now: float


@dataclass(frozen=True)
class Internal:
    """A deterministic local failure ckptless cannot plan around (e.g. the image does not fit the
    objects this script built): re-planning would meet it again, so the worker ends."""

    reason: str


@dataclass(frozen=True)
class DeviceFailed:
    """The GPU itself failed (an uncorrectable ECC error, a GPU off the bus: classified by its CUDA error
    code in :mod:`ckptless.worker.faults`). Neither the user's error nor a fault this process can
    recover from: its CUDA context is poisoned, so it cannot leave, report or restore; it exits, its
    agent marks that GPU bad, and the rank is recovered by a spare or a respawn on another GPU."""

    error: ErrorSummary


Event = Union[Started, MembershipSeen, Formed, FormFailed, Restored, RestoreFailed, Stepped, Reprotected, Fault,
              UserError, Committed, Left, Reported, JobEnded, CoordinatorLost, TimedOut, Internal, DeviceFailed]


# --- actions ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AwaitMembership:
    after: int  # -1 while joining
    deadline: float


@dataclass(frozen=True)
class FormGroups:
    generation: int
    deadline: float


@dataclass(frozen=True)
class RestoreState:
    generation: int


@dataclass(frozen=True)
class MarkReady:
    generation: int


@dataclass(frozen=True)
class Train:
    generation: int
    from_step: int
    until_reprotected: bool


@dataclass(frozen=True)
class WaitFinalCommit:
    generation: int


@dataclass(frozen=True)
class LeaveGroups:
    generation: int
    reason: str


@dataclass(frozen=True)
class Report:
    generation: int
    reason: str


@dataclass(frozen=True)
class Exit:
    kind: FailKind | Literal["finished"]
    message: str


Action = Union[AwaitMembership, FormGroups, RestoreState, MarkReady, Train, WaitFinalCommit, LeaveGroups, Report,
               Exit]
Step = tuple[State, tuple[Action, ...]]


def is_terminal(state: State) -> bool:
    return isinstance(state, (Finished, Failed))


def _fail(kind: FailKind, message: str) -> Step:
    return Failed(kind, message), (Exit(kind, message),)


def _leave(generation: int, reason: str) -> Step:
    return Leaving(generation, reason), (LeaveGroups(generation, reason),)


def _form(ev: MembershipSeen, cfg: WorkerConfig) -> Step:
    deadline = ev.now + cfg.form_timeout_s
    return Forming(ev.generation, deadline, ev.from_decision), (FormGroups(ev.generation, deadline),)


def step(state: State, event: Event, cfg: WorkerConfig) -> Step:
    """The whole worker: pure, total over (state, event); unexpected pairs keep the state."""
    if is_terminal(state):
        return state, ()
    if isinstance(event, JobEnded):
        return _fail("job_ended", event.reason)
    if isinstance(event, CoordinatorLost):
        return _fail("internal", f"the coordinator (etcd) is unreachable: {event.reason}")
    if isinstance(event, Internal):
        return _fail("internal", event.reason)
    if isinstance(event, UserError):
        return _fail("user_error", event.summary)
    if isinstance(event, DeviceFailed):
        # Corrupt replicated state (replica_check.py) is the device's or its memory's, GPU or not.
        what = "its replicated state is corrupt" if event.error.type == "SilentDataCorruption" else "the GPU failed"
        message = f"{what}: {event.error.one_line()}"
        return Failed("device", message, event.error), (Exit("device", message),)

    if isinstance(state, Joining):
        if isinstance(event, Started):
            deadline = event.now + (cfg.join_timeout_s if event.deadline_s is None else event.deadline_s)
            return Joining(deadline), (AwaitMembership(-1, deadline),)
        if isinstance(event, MembershipSeen) and event.includes_me:
            return _form(event, cfg)
        if isinstance(event, TimedOut):
            return _fail("internal", "not admitted to the job before the deadline")
        return state, ()

    if isinstance(state, Forming):
        if isinstance(event, Formed) and event.generation == state.generation:
            if state.restore:
                return Restoring(state.generation), (RestoreState(state.generation),)
            return (Training(state.generation, event.start_step),
                    (MarkReady(state.generation), Train(state.generation, event.start_step, False)))
        if isinstance(event, FormFailed):
            return _leave(state.generation, event.reason)
        if isinstance(event, Fault):
            return _leave(state.generation, event.reason)
        if isinstance(event, TimedOut):
            return _leave(state.generation, f"generation {state.generation} did not form before the deadline")
        return state, ()

    if isinstance(state, Restoring):
        if isinstance(event, Restored):
            return (Training(state.generation, event.step, reprotecting=True),
                    (MarkReady(state.generation), Train(state.generation, event.step, True)))
        if isinstance(event, (RestoreFailed, Fault)):
            return _leave(state.generation, event.reason)
        return state, ()

    if isinstance(state, Training):
        if isinstance(event, Reprotected):
            return Training(state.generation, event.step), (Train(state.generation, event.step, False),)
        if isinstance(event, Stepped):
            if event.done:
                return Finishing(state.generation), (WaitFinalCommit(state.generation),)
            return (Training(state.generation, event.step, state.reprotecting),
                    (Train(state.generation, event.step, state.reprotecting),))
        if isinstance(event, Fault):
            return _leave(state.generation, event.reason)
        return state, ()

    if isinstance(state, Finishing):
        if isinstance(event, Committed):
            return Finished(state.generation), (Exit("finished", f"finished in generation {state.generation}"),)
        if isinstance(event, Fault):
            return _leave(state.generation, event.reason)
        return state, ()

    if isinstance(state, Leaving):
        if isinstance(event, Left):
            return Reporting(state.generation, state.reason), (Report(state.generation, state.reason),)
        return state, ()

    if isinstance(state, Reporting):
        if isinstance(event, Reported):
            deadline = event.now + cfg.await_timeout_s
            return Awaiting(state.generation, deadline), (AwaitMembership(state.generation, deadline),)
        return state, ()

    if isinstance(state, Awaiting):
        if isinstance(event, MembershipSeen) and event.generation > state.generation:
            if not event.includes_me:
                return _fail("fenced", f"not part of generation {event.generation}: this worker was replaced")
            return _form(event, cfg)
        if isinstance(event, TimedOut):
            return _fail("internal", f"no generation after {state.generation} was published before the deadline")
        return state, ()
    raise TypeError(f"unknown state {state!r}")  # pragma: no cover - the Union above is exhaustive
