"""The user's own loop, kept: ``job.train(fn)`` with ``job.epochs`` and ``job.batches`` inside it.

Why: real scripts train in a nested loop, usually inside a ``Trainer`` class
(``for epoch in range(...): sampler.set_epoch(epoch); for x, y in loader:
...``). Flattening that into ``for step in job.steps(n)`` was the hardest part
of a port. Here the loop stays as written:

    job.train(trainer.train, max_epochs)          # instead of trainer.train(max_epochs)
    ...
    for epoch in ckptless.epochs(range(self.epochs_run, max_epochs)):
        self.train_data.sampler.set_epoch(epoch)
        for source, targets in ckptless.batches(self.train_data):
            self._run_batch(source, targets)

How: every batch is one step. Fetching a batch closes the previous step (the
version it completes is captured and mirrored, the coordinator's incidents
checked) and opens the next; what runs between two batches (an epoch's tail:
a per-epoch LR step, an eval pass, a print) belongs to the step before.
After a recovery the function is called again, from the top: ``job.epochs``
skips the epochs the resume version had finished, ``job.batches`` the passes
and the batches it had trained, so the loop reaches the resume version's
exact position (:mod:`ckptless.passes`) and goes on. A survivor that must roll
back leaves the function by an exception (:class:`Rewind`, a ``BaseException``
so that a script's ``except Exception`` does not stop it); a fault raised in
the function's body is classified as ``job.guard`` does.

Code between passes of a resumed epoch runs again (it runs before the pass it
precedes, which is re-entered); code between epochs does not (``job.epochs``
skips whole epochs). Without ``job.epochs`` a function may make one pass.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

from ckptless.errors import ConfigError, RecoveryError
from ckptless.passes import AFTER_EPOCHS, LoopPosition, adapted, is_stateful, open_pass, stop_workers
from ckptless.sample_seeds import refuse_unreproducible, seeds_per_pass
from ckptless.state import RNGState
from ckptless.worker import exit_file, exit_guard, training
from ckptless.worker import WorkerDriver
from ckptless.worker import Event, UserError

__all__ = ["LOOP_ENTRY", "LoopRunner", "Rewind"]

LOOP_ENTRY = "_ckptless_loop"
"""The name the loop's position is protected under."""

UNBOUNDED = sys.maxsize  # the run's step count until the function returns


class Rewind(BaseException):
    """Leaves the user's loop for ``job.train`` to call it again at the resume version's position."""


class LoopRunner:
    """Drives the worker's machine from the batches the user's loop fetches (see module doc)."""

    def __init__(self, driver: WorkerDriver) -> None:
        self.driver, self.rt = driver, driver.rt
        self.position = LoopPosition()
        self._it: Generator[int, Any, None] | None = None
        self._current = 0  # the step the machine waits on
        self._in_step = False  # a batch of that step is in hand (False: the machine's step has none yet)
        self._seen = (self.rt.generation, self.rt.recoveries)
        self._target: LoopPosition | None = None  # where this call of the function resumes (None: reached)
        self._in_epochs = False
        self._passes = 0  # job.batches passes begun in this epoch (or call, outside job.epochs)
        self._fatal: BaseException | None = None
        self._rng_at_call: dict[str, Any] | None = None
        self._shift = 0  # recorded ordinal - this call's index: a range that starts elsewhere now
        self._after_epochs = False  # the job.epochs loop of this call ended
        self._open_loops: list[Iterator[Any]] = []
        self._persistent: list[weakref.ref[Any]] = []  # loaders with persistent workers job.batches saw

    # --- the function ----------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        rt = self.rt
        self.driver.prepare(None, UNBOUNDED, 0)
        self._it = self.driver.drive_steps() if rt.recovery else training.plain_steps(rt)
        first = self._send(None, start=True)
        if first is None:
            raise RecoveryError(f"rank {rt.rank}: the worker ended before its first step")
        self._at(first)
        while True:
            self._begin_call()
            outcome: Event | None = None
            try:
                result = fn(*args, **kwargs)
            except Rewind:
                continue
            except SystemExit as exc:
                if exc.code in (None, 0) and exc is not self._fatal:
                    if self._finish():  # sys.exit(0) inside the function: it ended, as by returning
                        raise
                    continue
                if rt.recovery and exc is not self._fatal:
                    exit_file.write("user_error", exit_file.summarize(exc))
                    exit_guard.set_exit_code(exc.code if isinstance(exc.code, int) else 1)
                raise
            except (KeyboardInterrupt, GeneratorExit):
                raise
            except BaseException as exc:
                if exc is self._fatal or not rt.recovery:
                    raise
                outcome = training.classify(rt, exc)
                if isinstance(outcome, UserError):
                    exit_file.write("user_error", exit_file.summarize(exc))
                    exit_guard.set_exit_code(1)  # (a SystemExit left through the branch above)
                    raise
            if outcome is not None:  # a fault: (outside the except block, which pins the failed communicator)
                resume = self._send(outcome)
                if resume is None:
                    raise RecoveryError(f"rank {rt.rank}: the worker ended while recovering")
                self._at(resume)
                continue
            if self._finish():
                return result

    def _begin_call(self) -> None:
        for gen in self._open_loops:  # the last call's loops, left by an exception: closed before this one
            gen.close()  # type: ignore[attr-defined]
        self._open_loops = []
        self._target = self.position.copy()
        if self._target.at_start():
            # Back to version 0: the original run made its persistent workers in this call (torch draws a
            # base seed there, e.g. at a probe `next(iter(loader))`), as a replacement will; so do we.
            for ref in self._persistent:
                loader = ref()
                if loader is not None:
                    stop_workers(loader)
        self._in_epochs, self._after_epochs, self._passes, self._shift = False, False, 0, 0
        # Resuming mid-pass: the streams are the resume version's now; code on the way back to the
        # pass may draw again, and reopening it puts them back here (ckptless.passes.open_pass).
        self._rng_at_call = RNGState().state_dict() if self._target.opened else None

    def _send(self, event: Any, start: bool = False) -> int | None:
        """Feed the machine how the step ended; the next step it yields (None: the run is over)."""
        assert self._it is not None
        try:
            return next(self._it) if start else self._it.send(event)
        except StopIteration:
            return None
        except BaseException as exc:  # the machine failed or the job ended: leave as it says, unclassified
            self._fatal = exc
            raise

    def _at(self, step: int) -> None:
        """The machine waits on ``step`` with no batch of it in hand (a start, or a resume)."""
        self._current, self._in_step = step, False
        self._seen = (self.rt.generation, self.rt.recoveries)

    def _boundary(self) -> None:
        """A batch is in hand: it is the step the machine waits on, or it closes the step before."""
        if not self._in_step:
            self._in_step = True
            return
        step = self._send(None)
        if step is None:
            raise RecoveryError(f"rank {self.rt.rank}: the loop fetched a batch after the run's last step "
                                f"({self._current + 1}); does each call of the function make the same passes?")
        if step != self._current + 1 or (self.rt.generation, self.rt.recoveries) != self._seen:
            self._at(step)  # recovered: the state is the resume version's; the loop goes back there
            raise Rewind
        self._current = step

    def begin_step(self) -> None:
        """A framework's optimizer step begins (``job.begin_step``): it closes the step before, if any."""
        self._boundary()

    def _finish(self) -> bool:
        """The function returned: the run ends at the step in hand. False: recovered meanwhile, call it again."""
        rt = self.rt
        assert rt.spec is not None and self._it is not None
        end = self._current + 1 if self._in_step else self._current
        self.driver.end_at(end)
        if not self._in_step:
            if not rt.recovery:
                self._it.close()
                return True
            step = self._send(training.NO_MORE_STEPS)
        else:
            step = self._send(None)
        if step is None:
            return True
        self._at(step)  # a failure while the run ended (its final commit): the loop runs on from there
        return False

    # --- the loops inside it ---------------------------------------------------------------------
    def _check_running(self, what: str) -> None:
        if self._it is None:
            raise ConfigError("loop", what, "call it inside the function given to job.train(fn, ...)")

    def _refuse(self, field: str, value: Any, why: str) -> ConfigError:
        """The loop is misused: the script's error, left as it is (never taken for a fault)."""
        self._fatal = ConfigError(field, value, why)
        return self._fatal

    def epochs(self, iterable: Iterable[Any]) -> Iterator[Any]:
        self._check_running("job.epochs")
        if self._in_epochs:
            raise self._refuse("epochs", iterable, "job.epochs loops do not nest")
        t = self._target
        if t is not None and t.epoch is not None and t.ordinal >= 0 and isinstance(iterable, range) \
                and iterable.step > 0 and t.epoch < iterable.start and (iterable.start - t.epoch) % iterable.step == 0:
            # The script's own resume (an epochs_run read from its snapshot) is ahead of the resume
            # version: the protected position wins; the epochs in between run again.
            iterable = range(t.epoch, iterable.stop, iterable.step)
        gen = self._epochs(iterable)
        self._open_loops.append(gen)
        return gen

    def _epochs(self, iterable: Iterable[Any]) -> Iterator[Any]:
        self._in_epochs, self._after_epochs = True, False
        finished = False
        try:
            t = self._target
            if t is not None and t.ordinal == AFTER_EPOCHS:
                finished = True  # the resume version is past this loop: its epochs are all done
                return
            for ordinal, value in enumerate(iterable):
                t = self._target
                self._passes = 0
                if t is None or t.ordinal < 0:
                    self._target = None
                    self.position.begin_epoch(ordinal + self._shift, value)
                    yield value
                    continue
                if t.epoch is not None and type(value) is int:  # by value: the range may start elsewhere now
                    if value < t.epoch:
                        continue
                    if value > t.epoch:
                        raise self._refuse("epochs", value, f"the loop resumes in epoch {t.epoch}, which this "
                                                            "call of the function does not reach")
                elif ordinal < t.ordinal:
                    continue
                self._shift = t.ordinal - ordinal  # the resume epoch: its position is the restored one
                yield value
            finished = True
        finally:
            self._in_epochs, self._passes = False, 0
            self._after_epochs = finished

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        self._check_running("job.batches")
        inner = adapted(loader) or loader  # an Accelerate loader's workers are its inner DataLoader's
        try:
            refuse_unreproducible(inner)  # at the first pass: never trained on until a recovery shows it
        except ConfigError as exc:
            self._fatal = exc
            raise
        if seeds_per_pass(inner) and all(ref() is not inner for ref in self._persistent):
            self._persistent.append(weakref.ref(inner))
        k = self._passes
        self._passes += 1
        outside = not self._in_epochs
        if outside and k > 0 and not self._after_epochs:
            raise self._refuse("loop", "job.batches", "a second pass over data outside job.epochs: wrap the "
                                                      "epoch loop, `for epoch in job.epochs(range(...))`")
        here = (AFTER_EPOCHS if self._after_epochs else -1) if outside else None
        t, resume = self._target, None
        if t is not None:
            if outside and t.ordinal != here:
                return iter(())  # a pass before the epoch loop the resume version is in (or after)
            if k < t.pass_index:
                return iter(())  # a pass the resume version had finished
            self._target = None
            resume = self._rng_at_call if t.opened else None
        elif outside and k == 0:
            self.position.begin_epoch(here, None)  # type: ignore[arg-type]
        elif k > 0:
            self.position.next_pass()
        gen = self._pass(loader, resume)
        self._open_loops.append(gen)
        return gen

    def _pass(self, loader: Iterable[Any], resume: dict[str, Any] | None) -> Iterator[Any]:
        pos = self.position
        consumed = pos.consumed if resume is not None else 0
        it = open_pass(loader, pos, resume)
        if resume is not None:
            pos.restore_fetch()  # the streams as they were before the batch in hand was first fetched
        stateful = is_stateful(loader)
        in_process = not getattr(loader, "num_workers", 0)  # no worker processes: batches load here
        while True:
            before = loader.state_dict() if stateful else None  # type: ignore[attr-defined]
            pos.before_fetch(in_process)
            try:
                batch = next(it)
            except StopIteration:  # the pass is done: a version taken from here on reopens it empty
                pos.consumed = consumed
                pos.loader_state = loader.state_dict() if stateful else None  # type: ignore[attr-defined]
                return
            pos.consumed, pos.loader_state = consumed, before
            self._boundary()
            consumed += 1
            yield batch
