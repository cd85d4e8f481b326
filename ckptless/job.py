"""The user-facing job: ``init()``, ``protect()``, ``run()``, ``close()``.

Why a loop API (``run(train_step, steps)``): the framework must own the points
between steps to capture, mirror, commit and, after a failure, roll back and
resume. User code then holds no recovery logic: after a recovery its groups
(default, subgroups, DDP, FSDP2) work again and ``train_step`` is simply
called with the next step number.

How it is driven: a worker's life is the pure state machine of
:mod:`ckptless.worker.machine`, run by :class:`~ckptless.worker.driver.WorkerDriver`
(which owns all of the worker's state). This module only decides *when* to
drive: ``init()`` runs the machine until it needs the user's objects (a
replacement restores them only in ``run()``, after the script built them);
``run()`` and ``steps()`` run it to the end. Nothing under ``ckptless.worker``
imports this module.

Version ``v`` is the protected state after ``v`` completed steps.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ckptless import environment, loop_check, sample_seeds
from ckptless.carried import CARRIED_ENTRY, Carried
from ckptless.errors import ConfigError, RecoveryError
from ckptless.mirror import MirrorConfig
from ckptless.state import StateRegistry
from ckptless.worker import device, exit_file, exit_guard, rank_reads, setup_seed, training
from ckptless.worker import WorkerContext
from ckptless.worker import WorkerDriver
from ckptless.worker import Event, State, UserError, is_terminal
from ckptless.worker import RunResult, RunSpec

log = logging.getLogger(__name__)

__all__ = ["Job", "RunResult", "batches", "carry", "current", "epochs", "init"]

_UNSET: Any = object()
_CURRENT: list[Job] = []  # the job init() returned in this process


class Job:
    """One rank's handle on the protected training job (see :func:`init`)."""

    def __init__(self, ctx: WorkerContext, mirror_config: MirrorConfig | None = None) -> None:
        self._driver = WorkerDriver(ctx, mirror_config, environment.current().heartbeat_file)
        self._rt = self._driver.rt
        self._guard_outcome: Any = _UNSET
        self._loop: Any = None  # the job.train loop (ckptless.loop.LoopRunner), once it runs
        self._carried: Carried | None = None

    # --- what the script may read ----------------------------------------------------------------
    @property
    def ctx(self) -> WorkerContext:
        return self._rt.ctx

    @property
    def registry(self) -> StateRegistry:
        return self._rt.registry

    @property
    def rank(self) -> int:
        return self._rt.rank

    @property
    def world_size(self) -> int:
        return self._rt.world_size

    @property
    def generation(self) -> int:
        return self._rt.generation

    @property
    def device(self) -> torch.device:
        """The rank's own device: its GPU (made current by ``init()``), else the CPU."""
        return device.bound() or torch.device("cpu")

    @property
    def committed_version(self) -> int | None:
        return self._rt.committed_version

    @property
    def recoveries(self) -> int:
        return self._rt.recoveries

    @property
    def prebuilt(self) -> bool:
        """A warm spare that runs the script's setup as its standby rank before it has one."""
        return self._rt.prebuilt

    @property
    def hosted_rank(self) -> int | None:
        """Inside a lost rank's micro-batch (the job goes on with fewer ranks, ``--lost-node shrink``): that
        rank; None in this rank's own step. The step body runs once per hosted rank with the optimizer step,
        ``zero_grad``, the LR schedule's step and collectives held back; work the body does besides (an EMA
        update, a log line, a counter) can be skipped when this is not None."""
        micro = self._rt.micro
        return micro.current if micro is not None else None

    @property
    def spec(self) -> RunSpec | None:
        return self._rt.spec

    @property
    def state(self) -> State:
        return self._driver.state

    # --- protection ---------------------------------------------------------------------------------
    def protect(self, replicated_over: Any = None, **objs: Any) -> None:
        """Register Stateful objects (model, optimizer, scheduler, data position, extras).

        RNG streams are protected automatically under the name ``rng``. ``replicated_over`` (a process
        group or a list of ranks): every rank of it holds these objects identically, so a lost rank
        gets them from a live replica instead of a mirror (docs/state.md, "Replicated state"); a DDP
        model and HSDP's replicated shards are found without it.
        """
        for name, obj in objs.items():
            sample_seeds.refuse_unreproducible(obj, name)  # persistent workers a recovery cannot reproduce
            sample_seeds.install(obj)  # a loader's workers seeded per sample before its first state_dict()
        self._rt.registry.protect(replicated_over, **objs)
        self._rt.layout_changed()
        self._rt.make_snapshot_writer()

    def carry(self, *, ignore: Iterable[str] = (), **values: Any) -> Carried:
        """Protect the values the loop carries from one iteration to the next, in one line:
        ``c = job.carry(X=X, Y=Y, best_val_loss=1e9)``, then ``c.X`` / ``c.best_val_loss = ...`` in the loop.

        The values are in every version's image as they are at the end of the step's body (a batch
        the body prefetched for the next step, a metric it updated after its optimizer step) and are
        put back before the loop gets the resume step (:mod:`ckptless.carried`; docs/porting.md,
        "Loop-carried values"). Tensors stay on their device; values are checked as they are assigned
        (``ConfigError`` naming the attribute). ``ignore``: locals the loop carries that may differ
        after a recovery (a wall-clock ``t0``): the start-up check does not name them.
        """
        if self._carried is not None:
            raise ConfigError("carry", sorted(values), "job.carry(...) was already called: declare every "
                                                       "loop-carried value in that one call")
        if self._rt.spec is not None or self._loop is not None:
            raise ConfigError("carry", sorted(values), "call job.carry(...) before the loop starts (job.steps, "
                                                       "run, train): a replacement restores it there")
        carried = Carried(values, ignore)
        self.protect(**{CARRIED_ENTRY: carried})
        self._carried = carried
        return carried

    # --- the loop ------------------------------------------------------------------------------------
    def steps(self, steps: int, start_step: int = 0) -> Iterator[int]:
        """The loop API: ``for step in job.steps(n):`` with the body inside ``with job.guard():``.

        Yields the step to run next: after a recovery, the resume step (earlier
        steps are run again, exactly as ``run`` does). The guard is required:
        it decides whether an exception in the body is a fault (recovered: the
        next step yielded is the resume step) or the user's own error
        (re-raised: the job fails fast). Locals the body keeps across
        iterations are not protected, as with ``run``'s closures.
        """
        self._driver.prepare(None, steps, start_step)
        if self.rank == 0:  # the loop's own frame: the one that called next() on this generator
            loop_check.warn_unprotected(sys._getframe(1), self._carried)
        it: Generator[int, Event | None, None] = (
            self._driver.drive_steps() if self._rt.recovery else training.plain_steps(self._rt))  # type: ignore[assignment]
        try:
            step = next(it)
            while True:
                self._guard_outcome = _UNSET
                yield step
                outcome = self._guard_outcome
                if outcome is _UNSET:
                    raise ConfigError("loop", step, "wrap the body of `for step in job.steps(n):` in "
                                                    "`with job.guard():` so that a failure inside it is recovered")
                step = it.send(outcome)
        except StopIteration:
            self._driver.write_digest()
            return

    @contextmanager
    def guard(self) -> Iterator[None]:
        """One step of the loop API: a fault inside is recovered, the user's own error re-raised."""
        try:
            yield
        except (KeyboardInterrupt, GeneratorExit):
            raise
        except BaseException as exc:
            if not self._rt.recovery:
                raise
            event = training.classify(self._rt, exc)
            if isinstance(event, UserError):
                exit_file.write("user_error", exit_file.summarize(exc))
                code = exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 1
                exit_guard.set_exit_code(code)
                raise
            self._guard_outcome = event  # a fault: suppressed; the loop yields the resume step next
        else:
            self._guard_outcome = None

    def train(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(*args, **kwargs)``, the script's own training loop, protected; return what it returns.

        Keep the loop as written and iterate through the job: ``for epoch in job.epochs(range(...))``
        for the epoch loop, ``for batch in job.batches(loader)`` for each pass over a loader (or
        :func:`ckptless.epochs` / :func:`ckptless.batches` where ``job`` is out of reach, inside a
        ``Trainer``). Every batch is one step. After a recovery ``fn`` is called again and those
        loops resume at the resume version's exact position: the same batches in the same order
        (docs/porting.md, "Your own loop"; :mod:`ckptless.loop`).
        """
        from ckptless.loop import LOOP_ENTRY, LoopRunner

        if self._loop is not None or self._rt.spec is not None:
            raise ConfigError("train", fn, "a job trains once: train(), run() or steps() was already called")
        runner = LoopRunner(self._driver)
        self.protect(**{LOOP_ENTRY: runner.position})
        self._loop = runner
        try:
            return runner.run(fn, args, kwargs)
        finally:
            self._driver.write_digest()

    def epochs(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """The epoch loop inside :meth:`train`'s function: yields ``iterable``'s items, and after a
        recovery skips the epochs the resume version had finished (ints are matched by value, so
        ``range(self.epochs_run, n)`` may start elsewhere in a replacement)."""
        return self._runner("job.epochs").epochs(iterable)

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """One pass over ``loader`` (a ``DataLoader``, torchdata's ``StatefulDataLoader``, any
        iterable) inside :meth:`train`'s function, one step per batch; after a recovery, reopened at
        the resume version's batch (:mod:`ckptless.passes`)."""
        return self._runner("job.batches").batches(loader)

    def begin_step(self) -> None:
        """Inside :meth:`train`'s function, for a loop the job cannot iterate (a framework's trainer,
        ``ckptless.integrations``): a step begins, which closes the step before (its version captured
        and mirrored; after a recovery this leaves the function, which is called again)."""
        self._runner("job.begin_step").begin_step()

    def _runner(self, what: str) -> Any:
        if self._loop is None:
            raise ConfigError("loop", what, "call it inside the function given to job.train(fn, ...)")
        return self._loop

    def run(self, train_step: Callable[[int], Any], steps: int, start_step: int = 0) -> RunResult:
        """Call ``train_step(step)`` for ``step`` in ``[start_step, steps)``, protected and recovered."""
        self._driver.prepare(train_step, steps, start_step)
        if not self._rt.recovery:
            return training.run_without_recovery(self._rt)
        self._driver.drive()
        if not is_terminal(self._driver.state):
            raise RecoveryError(f"rank {self.rank}: the worker stopped in state {self._driver.state}")
        self._driver.write_digest()  # the run is over: a script that never calls close() is judged too
        return RunResult(steps - start_step, steps, self.committed_version, self.generation, self.recoveries)

    # --- the end --------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop mirroring and snapshots and leave the groups (idempotent)."""
        self._driver.close()

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _enable_crash_stacks() -> None:
    """A worker that dies on a fatal signal prints every thread's Python stack: cheap, and the
    only trace a native abort (SIGABRT/SIGSEGV) leaves."""
    import faulthandler

    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)


def init(env: dict[str, str] | None = None) -> Job:
    """Join the job from inside a ``ckptless-run`` (or torchrun) worker.

    Creates the default ``torch.distributed`` group (do not call
    ``init_process_group`` yourself). A member of the first generation is
    connected to its peers on return; a replacement or spare returns with its
    groups unbound (collectives answer locally) and joins its peers in
    ``run()``, after your script built its objects. A spare blocks here until
    the coordinator assigns it a rank. Where CUDA is available, the rank's GPU
    (``cuda:LOCAL_RANK``) is made current first (``ckptless.worker.device``).
    """
    t0 = time.monotonic()
    _enable_crash_stacks()
    ctx = WorkerContext.from_env(env)
    # Before anything of the setup runs: an unseeded script's setup draws the same in every incarnation.
    seed = environment.current().seed if env is None else environment.ProcessEnv.from_mapping(env).seed
    setup_seed.seed_if_unseeded(seed, announce=ctx.rank == 0 and ctx.role == "member" and ctx.generation == 0)
    # The rank's own GPU is current before anything is built or connected: its communicators, the
    # device an image is restored onto and the CUDA generator saved with the RNG all follow it.
    chosen = None if env is None else environment.ProcessEnv.from_mapping(env).cuda_backend
    device.bind(ctx.local_rank, chosen)
    job = Job(ctx)
    _CURRENT[:] = [job]
    if job.prebuilt:
        rank_reads.start(t0)  # the setup that follows is the standby rank's: does it read its rank?
    log.info("rank %d joined generation %d in %.3fs", job.rank, job.generation, time.monotonic() - t0)
    return job


def current() -> Job:
    """The job :func:`init` returned in this process (a ``Trainer`` class need not be handed it)."""
    if not _CURRENT:
        raise ConfigError("job", None, "ckptless.init() was not called in this process")
    return _CURRENT[0]


def epochs(iterable: Iterable[Any]) -> Iterator[Any]:
    """``current().epochs(iterable)``: the epoch loop inside ``job.train``'s function."""
    return current().epochs(iterable)


def carry(*, ignore: Iterable[str] = (), **values: Any) -> Carried:
    """``current().carry(**values)``: protect the loop-carried values (:meth:`Job.carry`)."""
    return current().carry(ignore=ignore, **values)


def batches(loader: Iterable[Any]) -> Iterator[Any]:
    """``current().batches(loader)``: one pass over a loader inside ``job.train``'s function."""
    return current().batches(loader)
