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
