"""Persistent loader workers under ``job.batches``: reproduced after a recovery, or refused at start (issue 35).

Finding 7: a ``DataLoader(num_workers=2, persistent_workers=True)`` whose
samples draw a random transform, a rank SIGKILLed mid-epoch: the job ended
with other model and optimizer states than the fault-free run, and nothing
said so. Persistent workers' streams carry over from every earlier pass, which
no reopening can replay. Here: the map-style ones are seeded per sample from a
base each pass draws (so the reopened pass draws what the original drew, and
epochs still differ), and the loaders that cannot be seeded so are refused
with one ``ConfigError`` before anything trains. The rollbacks themselves run
in tests/unit/test_loop.py (``persistent_augmented``); the SIGKILL in
tests/e2e/test_own_loop_e2e.py.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from ckptless.errors import ConfigError
from ckptless.loop import LOOP_ENTRY, LoopRunner
from ckptless.sample_seeds import SeedPerSample, install, seeds_per_pass, unreproducible

from .test_loop import Augmented, Counting, FakeDriver, Squares, epoch_loop, run_loop

stateful = pytest.importorskip("torchdata.stateful_dataloader")


def _loader(kind: str, iterable: bool, batched: bool, workers: int, persistent: bool) -> Any:
    data = Counting(12) if iterable else Squares(12)
    cls = stateful.StatefulDataLoader if kind == "stateful" else DataLoader
    return cls(data, batch_size=3 if batched else None, num_workers=workers, persistent_workers=persistent)


@pytest.mark.parametrize(("kind", "iterable", "batched", "workers", "persistent"), [
    c for c in itertools.product(["torch", "stateful"], [False, True], [False, True], [0, 2], [False, True])
    if c[3] or not c[4]])  # persistent_workers needs workers (DataLoader's own refusal)
def test_which_loaders_are_seeded_per_pass_and_which_refused(kind: str, iterable: bool, batched: bool,
                                                             workers: int, persistent: bool) -> None:
    """Only persistent workers are ever refused; of them, a torch DataLoader's map-style batches are seeded
    per pass, and every other (a stateful loader's own resume, an iterable, ``batch_size=None``) refused."""
    loader = _loader(kind, iterable, batched, workers, persistent)
    per_pass = persistent and kind == "torch" and not iterable and batched
    assert seeds_per_pass(loader) == per_pass
    why = unreproducible(loader)
    assert (why is not None) == (persistent and not per_pass), why


def test_the_refusal_is_one_line_naming_the_loader_and_the_fix() -> None:
    driver = FakeDriver({})
    runner = LoopRunner(driver)  # type: ignore[arg-type]
    driver.rt.registry.protect(**{LOOP_ENTRY: runner.position})
    loader = DataLoader(Counting(12), batch_size=3, num_workers=2, persistent_workers=True)
    trained = []

    def fn() -> None:
        for batch in runner.batches(loader):
            trained.append(batch)
    with pytest.raises(ConfigError) as err:
        runner.run(fn, (), {})
    text = str(err.value)
    assert "persistent_workers=False" in text and "DataLoader over Counting" in text and "\n" not in text, text
    assert trained == [] and loader._iterator is None  # nothing loaded, no worker started


def _rows(make: Any, epochs: int, probe: bool = False) -> tuple[list[dict[int, tuple[int, ...]]], torch.Tensor]:
    """Each epoch's sample -> transform through job.batches, and a draw after the loop (the stream's end)."""
    torch.manual_seed(5)
    driver = FakeDriver({})
    runner = LoopRunner(driver)  # type: ignore[arg-type]
    driver.rt.registry.protect(**{LOOP_ENTRY: runner.position})
    loader = make()
    out: list[dict[int, tuple[int, ...]]] = []

    def fn() -> None:
        for _ in runner.epochs(range(epochs)):
            if probe:
                next(iter(loader))  # the tutorial's probe: starts the persistent workers before job.batches
            out.append({r[0]: tuple(r[1:]) for b in runner.batches(loader) for r in b.tolist()})
    runner.run(fn, (), {})
    return out, torch.rand(2)


def test_persistent_workers_draw_other_transforms_every_epoch() -> None:
    """Keyed by their one base seed, a sample would get one transform for the whole job (shuffle=False:
    the same batches every epoch); each pass draws the base instead, as a non-persistent loader's does."""
    rows, _ = _rows(lambda: DataLoader(Augmented(12), batch_size=3, num_workers=2, persistent_workers=True), 3)
    for a, b in itertools.combinations(rows, 2):
        assert sum(a[i] != b[i] for i in range(12)) >= 10


def test_persistent_workers_draw_what_workers_started_per_pass_draw() -> None:
    """The same transforms, and the global stream left in the same place, as the non-persistent loader:
    each pass draws one base seed, and the workers are started without drawing from the stream."""
    def make(persistent: bool) -> Any:
        return lambda: DataLoader(Augmented(12), batch_size=3, shuffle=True, num_workers=2,
                                  persistent_workers=persistent)
    got, end = _rows(make(True), 2)
    want, want_end = _rows(make(False), 2)
    assert got == want and torch.equal(end, want_end)


def test_workers_a_probe_started_before_the_seeding_are_replaced() -> None:
    """A probe ``next(iter(loader))`` before the first job.batches starts persistent workers without the
    seeding: the pass replaces them (the rollbacks with a probe: test_loop's ``persistent_augmented``)."""
    loaders: list[Any] = []

    def make() -> Any:
        loaders.append(DataLoader(Augmented(12), batch_size=3, shuffle=True, num_workers=2, persistent_workers=True))
        return loaders[-1]
    rows, _ = _rows(make, 2, probe=True)
    assert rows[0] != rows[1]
    assert loaders[0]._iterator._worker_init_fn is loaders[0].worker_init_fn  # the seeded workers'


def test_install_gives_persistent_workers_one_shared_slot() -> None:
    loader = DataLoader(Squares(12), batch_size=3, num_workers=2, persistent_workers=True,
                        worker_init_fn=print)
    install(loader)
    init = loader.worker_init_fn
    install(loader)
    assert isinstance(init, SeedPerSample) and loader.worker_init_fn is init and init.user is print
    assert init.shared is not None and init.shared.is_shared()


@pytest.mark.parametrize("plan", [{3: 0}, {1: 0}, {9: 0, 12: 10}])
def test_a_rollback_to_version_0_with_a_probe_resumes_exactly(plan: dict[int, int]) -> None:
    """The DDP tutorial's probe starts the persistent workers in the first epoch, drawing torch's base seed:
    a survivor rolled back to version 0 (a failure before version 1 was committed) starts them again, so its
    probe draws as the original's did (was: the survivor's probe reused them, drew nothing, and every later
    dropout mask and pass seed differed)."""
    def make() -> Any:
        return DataLoader(Augmented(24), batch_size=3, shuffle=True, num_workers=2, persistent_workers=True)
    baseline = run_loop(make, epoch_loop, 2, {})
    assert run_loop(make, epoch_loop, 2, plan).same(baseline)
