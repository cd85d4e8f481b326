"""``job.train`` with ``job.epochs``/``job.batches``: the user's own loop resumes exactly after rollbacks.

The loop runner (``ckptless.loop``) is driven here by a stand-in of the worker's
machine that does what the real one does at a recovery, in one process: it
captures every protected object's state at each version (the loop position,
every RNG stream, what was trained), and at the chosen steps restores an earlier
version and yields it as the resume step. The function then runs again from the
top. The decisive check: the record of trained batches (protected, so rolled
back with the rest) and the RNG streams end equal to the run without rollbacks,
for real ``DataLoader``\\ s (``DistributedSampler`` with ``set_epoch``, a
shuffling ``RandomSampler``, its own ``generator``, a probe ``next(iter(loader))``,
workers, an ``IterableDataset``) and torchdata's ``StatefulDataLoader``.
The same logic with real processes, etcd and a SIGKILL runs in
tests/e2e/test_own_loop_e2e.py.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import random
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset, RandomSampler, Subset

from ckptless.errors import ConfigError
from ckptless.loop import LOOP_ENTRY, LoopRunner
from ckptless.state.registry import StateRegistry
from ckptless.worker import training
from ckptless.worker.runtime import RunSpec

from ..harness.state import assert_same


class Squares(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, i * i])


class Jittered(Squares):
    """A random transform drawn from the global torch and Python streams while the batch loads."""

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, i * i]) + torch.randint(0, 100, (2,)) + random.randint(0, 100)


class NumpyJittered(Squares):
    """A random transform drawn from NumPy's global stream while the batch loads in this process."""

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, i * i]) + int(np.random.randint(0, 100))


class Counting(IterableDataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        return iter(torch.tensor([i, 2 * i]) for i in range(self.n))


class Record:
    """What was trained, step by step: protected, so a rollback drops what came after the version."""

    def __init__(self) -> None:
        self.items: list[str] = []

    def add(self, batch: Any, noise: torch.Tensor) -> None:
        data = torch.as_tensor(batch).numpy().tobytes() + noise.numpy().tobytes()
        self.items.append(hashlib.sha256(data).hexdigest()[:16])

    def state_dict(self) -> dict[str, Any]:
        return {"items": list(self.items)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.items = list(state["items"])


@dataclass
class FakeRuntime:
    registry: StateRegistry = field(default_factory=StateRegistry)
    generation: int = 0
    recoveries: int = 0
    recovery: bool = True
    rank: int = 0
    spec: RunSpec | None = None


class FakeDriver:
    """The machine, reduced to what the loop sees: versions captured at every step, rollbacks on cue."""

    def __init__(self, rollbacks: dict[int, int]) -> None:
        self.rt = FakeRuntime()
        self.rollbacks = dict(rollbacks)  # at step s (version s just captured): go back to version v

    def prepare(self, train_step: Any, steps: int, start_step: int) -> None:
        self.rt.spec = RunSpec(train_step, steps, start_step)

    def end_at(self, steps: int) -> None:
        assert self.rt.spec is not None
        self.rt.spec = dataclasses.replace(self.rt.spec, steps=steps)

    def _capture(self) -> dict[str, Any]:
        return {name: copy.deepcopy(obj.state_dict()) for name, obj in self.rt.registry.items()}

    def _restore(self, image: dict[str, Any]) -> None:
        for name, obj in self.rt.registry.items():
            obj.load_state_dict(copy.deepcopy(image[name]))

    def drive_steps(self) -> Generator[int, Any, None]:
        versions = {0: self._capture()}
        step = 0
        event = yield 0
        while True:
            assert self.rt.spec is not None
            if isinstance(event, training.NoMoreSteps):
                return
            step += 1
            versions[step] = self._capture()
            back = self.rollbacks.pop(step, None)
            if back is not None:
                self._restore(versions[back])
                self.rt.generation += 1
                self.rt.recoveries += 1
                step = back
            elif step >= self.rt.spec.steps:
                return
            event = yield step


@dataclass
class Outcome:
    record: list[str]
    draw: torch.Tensor
    calls: int
    position: dict[str, Any]

    def same(self, other: Outcome) -> bool:
        """Everything a digest compares: the record, the RNG, the loop's protected position (tensors by bits)."""
        assert self.record == other.record
        assert torch.equal(self.draw, other.draw)
        assert_same(self.position, other.position, "position")
        return True


def run_loop(make_loader: Callable[[], Any], fn_body: Callable[..., None], epochs: int,
             rollbacks: dict[int, int], extra: Callable[[Any], dict[str, Any]] | None = None) -> Outcome:
    """Run ``fn_body`` as job.train's function (``extra``: more objects to protect, made from the loader)."""
    torch.manual_seed(1234)
    random.seed(1234)
    np.random.seed(1234)
    driver = FakeDriver(rollbacks)
    runner = LoopRunner(driver)  # type: ignore[arg-type]
    record = Record()
    driver.rt.registry.protect(record=record, **{LOOP_ENTRY: runner.position})
    loader = make_loader()
    if extra is not None:
        driver.rt.registry.protect(**extra(loader))
    calls = [0]

    def fn() -> None:
        calls[0] += 1
        fn_body(runner, loader, record, epochs)

    runner.run(fn, (), {})
    assert not driver.rollbacks, f"rollbacks never reached: {driver.rollbacks}"
    return Outcome(record.items, torch.rand(3), calls[0], runner.position.state_dict())


def epoch_loop(runner: LoopRunner, loader: Any, record: Record, epochs: int) -> None:
    """The DDP tutorial's shape: a probe, set_epoch, one pass per epoch, an RNG draw per batch."""
    for epoch in runner.epochs(range(epochs)):
        _ = next(iter(loader))  # the tutorial's batch-size probe: a pass of its own, drawing a base seed
        sampler = getattr(loader, "sampler", None)
        if isinstance(sampler, DistributedSampler):
            sampler.set_epoch(epoch)
        for batch in runner.batches(loader):
            record.add(batch, torch.rand(2))


def restarts_from_its_snapshot(runner: LoopRunner, loader: Any, record: Record, epochs: int) -> None:
    """The DDP tutorial's own resume: ``range(self.epochs_run, n)`` where ``epochs_run`` comes from a
    file the script wrote at an epoch's end (not protected: it survives a rollback, as a disk file does)."""
    for epoch in runner.epochs(range(DISK.get("epochs_run", 0), epochs)):
        loader.sampler.set_epoch(epoch)
        for batch in runner.batches(loader):
            record.add(batch, torch.rand(2))
        DISK["epochs_run"] = epoch


DISK: dict[str, int] = {}


def passes_around_the_epochs(runner: LoopRunner, loader: Any, record: Record, epochs: int) -> None:
    """A pass before the epoch loop (a warm-up), epochs, and two passes after it (a test pass, a report)."""
    for batch in runner.batches(loader):
        record.add(batch, torch.rand(1))
    for _ in runner.epochs(range(epochs)):
        for batch in runner.batches(loader):
            record.add(batch, torch.rand(2))
    for batch in runner.batches(loader):
        record.add(batch, torch.zeros(1))
    for batch in runner.batches(loader):
        record.add(batch, torch.ones(1))


def train_and_eval(runner: LoopRunner, loader: Any, record: Record, epochs: int) -> None:
    """minGPT's shape: epochs counted from 1, a train pass and an eval pass per epoch, both stepped."""
    for epoch in runner.epochs(range(epochs)):
        epoch += 1
        loader.sampler.set_epoch(epoch)
        for batch in runner.batches(loader):
            record.add(batch, torch.rand(2))
        for batch in runner.batches(loader):
            record.add(batch, torch.zeros(2))


LOADERS: dict[str, Callable[[], Any]] = {
    "distributed": lambda: DataLoader(Squares(40), batch_size=4, sampler=DistributedSampler(
        Squares(40), num_replicas=2, rank=1, shuffle=True, seed=3)),
    "shuffle": lambda: DataLoader(Squares(23), batch_size=3, shuffle=True),
    "generator": lambda: DataLoader(Squares(23), batch_size=3, shuffle=True,
                                    generator=torch.Generator().manual_seed(7)),
    "drop_last": lambda: DataLoader(Squares(23), batch_size=5, shuffle=True, drop_last=True),
    "iterable": lambda: DataLoader(Counting(17), batch_size=4),
    "jittered": lambda: DataLoader(Jittered(23), batch_size=3, shuffle=True),
    "numpy_jittered": lambda: DataLoader(NumpyJittered(23), batch_size=3, shuffle=True),
}


def _rollback_plans(total: int, first: int = 0, back: int | None = None) -> st.SearchStrategy[dict[int, int]]:
    """Up to three rollbacks, each to a version (``first`` or later, at most ``back`` behind) at or before
    the step it happens at."""
    pair = st.integers(max(1, first), total).flatmap(
        lambda s: st.tuples(st.just(s), st.integers(max(first, s - back if back is not None else 0), s)))
    return st.lists(pair, max_size=3, unique_by=lambda p: p[0]).map(dict)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(sorted(LOADERS)), epochs=st.integers(1, 3), data=st.data())
def test_epoch_loop_resumes_exactly_after_any_rollbacks(kind: str, epochs: int, data: st.DataObject) -> None:
    baseline = run_loop(LOADERS[kind], epoch_loop, epochs, {})
    assert baseline.calls == 1
    # A loader's own generator is the script's state, not protected: a pass restores it from what it
    # recorded when it opened, so only version 0 (no pass opened yet) finds it where a survivor left it.
    plan = data.draw(_rollback_plans(len(baseline.record), first=1 if kind == "generator" else 0), label="rollbacks")
    got = run_loop(LOADERS[kind], epoch_loop, epochs, plan)
    assert got.same(baseline)
    assert got.calls == 1 + len(plan)


@settings(max_examples=20, deadline=None)
@given(data=st.data())
def test_passes_before_and_after_the_epoch_loop_resume_exactly(data: st.DataObject) -> None:
    baseline = run_loop(LOADERS["shuffle"], passes_around_the_epochs, 2, {})
    plan = data.draw(_rollback_plans(len(baseline.record)), label="rollbacks")
    assert run_loop(LOADERS["shuffle"], passes_around_the_epochs, 2, plan).same(baseline)


def test_a_snapshot_newer_than_the_resume_version_runs_its_epochs_again() -> None:
    """The script's own snapshot says epoch 1 is done; the resume version is inside epoch 1: the
    protected position wins (the epoch iterable is a range, so it is widened back)."""
    DISK.clear()
    baseline = run_loop(LOADERS["distributed"], restarts_from_its_snapshot, 3, {})
    DISK.clear()
    got = run_loop(LOADERS["distributed"], restarts_from_its_snapshot, 3, {11: 8})  # 5 steps an epoch
    assert got.same(baseline) and got.calls == 2


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_a_range_that_starts_elsewhere_after_a_restart_resumes_by_value(data: st.DataObject) -> None:
    DISK.clear()
    baseline = run_loop(LOADERS["distributed"], restarts_from_its_snapshot, 3, {})
    DISK.clear()
    # A real rollback goes to the newest committed version (one behind with mirror_every=1): never to
    # before the epoch whose end the script's snapshot file records.
    plan = data.draw(_rollback_plans(len(baseline.record), back=1), label="rollbacks")
    got = run_loop(LOADERS["distributed"], restarts_from_its_snapshot, 3, plan)
    assert got.same(baseline)


@settings(max_examples=15, deadline=None)
@given(epochs=st.integers(1, 2), data=st.data())
def test_train_and_eval_passes_per_epoch_resume_exactly(epochs: int, data: st.DataObject) -> None:
    baseline = run_loop(LOADERS["distributed"], train_and_eval, epochs, {})
    plan = data.draw(_rollback_plans(len(baseline.record)), label="rollbacks")
    assert run_loop(LOADERS["distributed"], train_and_eval, epochs, plan).same(baseline)


class Augmented(Squares):
    """A random transform drawn in a loader worker from its torch, ``random`` and NumPy streams."""

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, int(torch.randint(0, 1000, ())), random.randint(0, 999), int(np.random.randint(1000))])


class BatchedAugmented(Augmented):
    """The same, fetched a batch at a time (``__getitems__``, as HF datasets and ``Subset`` do)."""

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        return [self[i] for i in indices]


WORKER_LOADERS: dict[str, Callable[[], DataLoader]] = {
    "plain": lambda: DataLoader(Squares(24), batch_size=3, shuffle=True, num_workers=2),
    "persistent": lambda: DataLoader(Squares(24), batch_size=3, shuffle=True, num_workers=2, persistent_workers=True),
    "augmented": lambda: DataLoader(Augmented(24), batch_size=3, shuffle=True, num_workers=2),
    # issue 35, finding 7 (was: other transforms after the rollback: their streams carried over every pass)
    "persistent_augmented": lambda: DataLoader(Augmented(24), batch_size=3, shuffle=True, num_workers=2,
                                               persistent_workers=True),
    "persistent_batched": lambda: DataLoader(BatchedAugmented(24), batch_size=3, num_workers=2,
                                             persistent_workers=True),
    "batched": lambda: DataLoader(BatchedAugmented(24), batch_size=3, shuffle=True, num_workers=2),
    "subset": lambda: DataLoader(Subset(Augmented(40), list(range(0, 40, 2))[:24]), batch_size=3, shuffle=True,
                                 num_workers=2),
    "replacement": lambda: DataLoader(Augmented(6), batch_size=3, num_workers=2,
                                      sampler=RandomSampler(range(6), replacement=True, num_samples=24)),
}


@pytest.mark.parametrize("kind", sorted(WORKER_LOADERS))
def test_loader_workers_resume_mid_epoch_exactly(kind: str) -> None:
    """Two worker processes (and persistent ones): a rollback into the middle of an earlier epoch. With
    random transforms in the workers (was: other numbers after a mid-pass reopening, silently), through
    ``Subset``'s batched fetch, and with indices drawn twice in a pass."""
    baseline = run_loop(WORKER_LOADERS[kind], epoch_loop, 2, {})
    got = run_loop(WORKER_LOADERS[kind], epoch_loop, 2, {12: 5, 14: 9})
    assert got.same(baseline) and got.calls == 3


def test_an_index_drawn_twice_in_a_pass_gets_two_transforms() -> None:
    """Seeded by (the pass, the batch's indices, the place in the batch), not by the index alone: an
    oversampled index is not trained on as exact copies."""
    from ckptless.sample_seeds import SeedPerSample

    loader = DataLoader(Augmented(4), batch_size=4, num_workers=2, worker_init_fn=SeedPerSample(None),
                        sampler=RandomSampler(range(4), replacement=True, num_samples=32,
                                              generator=torch.Generator().manual_seed(3)))
    rows: dict[int, set[tuple[int, ...]]] = {}
    count: dict[int, int] = {}
    for batch in loader:
        for r in batch.tolist():
            rows.setdefault(r[0], set()).add(tuple(r[1:]))
            count[r[0]] = count.get(r[0], 0) + 1
    assert all(len(rows[i]) == count[i] for i in rows), (rows, count)


def test_worker_transforms_stay_independent_across_samples_and_epochs() -> None:
    """Seeded per sample from (the pass's base seed, the index): not one transform for every sample,
    nor the same transform for a sample in every epoch."""
    from ckptless.sample_seeds import SeedPerSample

    loader = DataLoader(Augmented(24), batch_size=3, shuffle=True, num_workers=2, worker_init_fn=SeedPerSample(None))
    torch.manual_seed(0)
    rows = [{r[0]: tuple(r[1:]) for b in loader for r in b.tolist()} for _ in range(2)]  # two passes (epochs)
    assert len(set(rows[0].values())) == 24
    assert sum(rows[0][i] != rows[1][i] for i in range(24)) >= 20


@pytest.mark.parametrize("seeded", [True, False])
def test_a_stateful_loader_restored_mid_epoch_draws_the_same_transforms_only_when_seeded(seeded: bool) -> None:
    """The flat loop's path (a StatefulDataLoader protected with job.protect: its state_dict() captured,
    load_state_dict() at a restore): torchdata's own resume draws other numbers in its workers; seeded
    per sample (what job.protect installs) it draws the same."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    from ckptless.sample_seeds import install

    def make() -> Any:
        loader = stateful.StatefulDataLoader(Augmented(24), batch_size=3, shuffle=True, num_workers=2,
                                             generator=torch.Generator().manual_seed(1))
        if seeded:
            install(loader)
        return loader

    it = iter(make())
    full = [next(it) for _ in range(8)]
    first = make()
    it = iter(first)
    for _ in range(3):
        next(it)
    state = first.state_dict()
    restored = make()
    restored.load_state_dict(state)
    it = iter(restored)
    same = all(torch.equal(next(it), want) for want in full[3:])
    assert same == seeded


@pytest.mark.parametrize("dataset", [Squares, Augmented])
def test_stateful_dataloader_resumes_from_its_own_state(dataset: type[Squares]) -> None:
    """torchdata's StatefulDataLoader (shuffle, workers): reopened from its state before the batch. With
    random transforms in the workers: torchdata's own resume draws other numbers there, ckptless's
    per-sample seeding makes them the same."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")

    def make() -> Any:
        return stateful.StatefulDataLoader(dataset(30), batch_size=4, shuffle=True, num_workers=2)
    baseline = run_loop(make, epoch_loop, 2, {})
    assert run_loop(make, epoch_loop, 2, {5: 2, 11: 7, 13: 8}).same(baseline)


def test_loops_outside_train_and_second_pass_without_epochs_are_refused() -> None:
    driver = FakeDriver({})
    runner = LoopRunner(driver)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="inside the function given to job.train"):
        runner.batches([1, 2])
    driver.rt.registry.protect(**{LOOP_ENTRY: runner.position})

    def two_passes() -> None:
        for _ in runner.batches([1, 2]):
            pass
        for _ in runner.batches([1, 2]):
            pass
    with pytest.raises(ConfigError, match="outside job.epochs"):
        runner.run(two_passes, (), {})
