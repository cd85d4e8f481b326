"""The loop API's contract on one process (no coordinator): steps are yielded in order, the guard is
required, and the user's own error propagates. Recovery through the loop API: tests/e2e/test_recovery_e2e.py."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

import ckptless
from ckptless.errors import ConfigError
from ckptless.job import Job


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def job() -> Iterator[Job]:
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "LOCAL_RANK": "0"}
    j = ckptless.init(env)
    try:
        yield j
    finally:
        j.close()
        if dist.is_initialized():
            dist.destroy_process_group()  # later in-process tests start their own default group
        del store


def _fresh(job: Job) -> Job:
    job._rt.spec = None  # each case trains once (the test reuses one job; a script trains once)
    return job


def test_steps_yields_every_step_in_order(job: Job) -> None:
    model = torch.nn.Linear(2, 1)
    if "model" not in job.registry:
        job.protect(model=model)
    seen = []
    for step in _fresh(job).steps(5, start_step=1):
        with job.guard():
            seen.append(step)
    assert seen == [1, 2, 3, 4]
    assert dist.get_world_size() == 1 and dist.get_backend() == "ckptless"


def test_guard_is_required(job: Job) -> None:
    with pytest.raises(ConfigError, match="job.guard"):
        for _ in _fresh(job).steps(3):
            pass


def test_user_error_propagates_out_of_the_loop(job: Job) -> None:
    with pytest.raises(ValueError, match="boom"):
        for step in _fresh(job).steps(3):
            with job.guard():
                if step == 1:
                    raise ValueError("boom")


def test_protect_seeds_a_loaders_workers_per_sample_before_its_first_state(job: Job) -> None:
    """A StatefulDataLoader protected for a flat loop: job.protect wraps its worker_init_fn before the
    first capture's state_dict() starts its workers (with a job.batches loop the pass installs it too)."""
    from torch.utils.data import DataLoader

    from ckptless.sample_seeds import SeedPerSample, install

    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    data = list(range(8))
    loader = stateful.StatefulDataLoader(data, batch_size=2, num_workers=2)
    in_process = stateful.StatefulDataLoader(data, batch_size=2)
    job.protect(seeded_loader=loader, in_process_loader=in_process)
    assert isinstance(loader.worker_init_fn, SeedPerSample)
    assert in_process.worker_init_fn is None  # left as it was
    plain = DataLoader(data, batch_size=2, num_workers=2)
    install(plain)
    install(plain)
    assert isinstance(plain.worker_init_fn, SeedPerSample) and plain.worker_init_fn.user is None  # wrapped once


def test_protect_refuses_a_stateful_loader_with_persistent_workers_naming_it(job: Job) -> None:
    """Issue 35, finding 7: its own resume restarts workers whose streams the original's had advanced over
    earlier epochs (other random transforms after a recovery, silently): one line at start instead."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    persistent = stateful.StatefulDataLoader(list(range(8)), batch_size=2, num_workers=2, persistent_workers=True)
    with pytest.raises(ConfigError) as err:
        job.protect(train_loader=persistent)
    text = str(err.value)
    assert "'train_loader'" in text and "StatefulDataLoader" in text and "persistent_workers=False" in text, text
    assert "\n" not in text and "train_loader" not in dict(job.registry.items())


def test_carry_protects_one_namespace_declared_in_one_call(job: Job) -> None:
    c = _fresh(job).carry(X=torch.zeros(2), best_val_loss=1e9, ignore=("t0",))
    assert job.registry["carried"] is c and c.best_val_loss == 1e9 and c.names == {"X", "best_val_loss", "t0"}
    with pytest.raises(ConfigError, match="already called"):
        job.carry(n=0)


def test_steps_names_the_locals_its_loop_carries_unprotected(job: Job, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    best, X = 1e9, torch.zeros(1)
    with caplog.at_level(logging.WARNING, logger="ckptless.loop_check"):
        for step in _fresh(job).steps(3):
            with job.guard():
                if float(X.sum()) < best:
                    best = float(X.sum())
                X = torch.full((1,), float(step))
    named = [r.getMessage() for r in caplog.records if "carries unprotected" in r.getMessage()]
    assert len(named) == 1 and "from one iteration to the next: X, best" in named[0], named
