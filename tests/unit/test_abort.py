"""The way out of a broken generation (ckptless/worker/abort.py), on one process with fake backends.

The end-to-end case (survivors of a kill on a backend with NCCL's semantics leave the hung step and
end bitwise): tests/e2e/test_nccl_semantics_e2e.py.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from ckptless import environment
from ckptless.errors import ConfigError
from ckptless.worker import abort, forming, groups, nccl_env, rebindable
from ckptless.worker.rebindable import RebindableGroup


class FakeNccl:
    """Stands for a ProcessGroupNCCL: records abort() and the thread it ran on."""

    def __init__(self) -> None:
        self.aborted_on: list[str] = []
        self.done = threading.Event()

    def abort(self) -> None:
        self.aborted_on.append(threading.current_thread().name)
        self.done.set()


def _bound(generation: int) -> tuple[RebindableGroup, FakeNccl]:
    g = RebindableGroup(0, 2, [0, 1], timedelta(seconds=5))
    fake = FakeNccl()
    g.install(generation, object(), [fake])  # type: ignore[arg-type]
    return g, fake


def test_only_the_bound_generation_is_aborted() -> None:
    g, fake = _bound(3)
    assert g.abort(2) == 0 and fake.aborted_on == []
    assert g.abort(3) == 1 and fake.done.wait(5) and len(fake.aborted_on) == 1
    assert g.broken_generation == 3
    assert g.abort(3) == 0  # once per backend


def test_a_failed_collective_aborts_its_generation_off_the_calling_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    g, fake = _bound(7)
    monkeypatch.setattr(groups, "groups", lambda: [g])
    shut: list[int] = []
    monkeypatch.setattr(abort.sockets, "shutdown", lambda gen: shut.append(gen))
    monkeypatch.setattr(rebindable, "_broken_listeners", [])  # this process's listeners come back afterwards
    abort.install()
    g.mark_broken(7)  # as a done-callback or a failed wait() does
    assert fake.done.wait(5), "the aborter thread never aborted the backend"
    # Off the calling thread, and off the aborter's too: an NCCL abort may wait for an init in progress.
    assert fake.aborted_on == ["ckptless-abort-g7"] and shut == [7]
    g.mark_broken(7)  # seen again: no second abort
    abort.request(7, "again")
    assert fake.aborted_on == ["ckptless-abort-g7"]


class SlowNccl(FakeNccl):
    """An abort that blocks, as ProcessGroupNCCL's does while a non-blocking init is in progress."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def abort(self) -> None:
        self.release.wait(10)
        super().abort()


def test_a_blocking_abort_holds_up_nobody_and_a_late_backend_is_aborted_as_it_is_made() -> None:
    slow, late = SlowNccl(), FakeNccl()
    forming.add(41, slow)
    assert forming.abort(41) == 1  # returns at once: the abort runs on its own thread
    assert not slow.done.is_set()
    forming.add(41, late)  # the formation's helper built one more after the give-up
    assert late.done.wait(5), "a backend made for an aborted generation was not aborted"
    slow.release.set()
    assert slow.done.wait(5)
    forming.forget(41)
    assert 41 not in forming._aborted_generations


def test_broken_listeners_hear_each_generation_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rebindable, "_broken_listeners", [])
    heard: list[int] = []
    rebindable.on_broken(heard.append)
    g = RebindableGroup(0, 1, [0], timedelta(seconds=5))
    g.mark_broken(1)
    g.mark_broken(1)
    g.mark_broken(0)  # older than the one already broken: nothing new
    g.mark_broken(2)
    assert heard == [1, 2]


@pytest.mark.parametrize("mode", ["1", "3"])
def test_a_worker_refuses_an_nccl_mode_that_tears_it_down(mode: str) -> None:
    with pytest.raises(ConfigError, match="TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        nccl_env.check({"TORCH_NCCL_ASYNC_ERROR_HANDLING": mode})


@pytest.mark.parametrize("mode", [None, "0", "2"])
def test_modes_that_keep_the_process_are_accepted(mode: str | None) -> None:
    env = {} if mode is None else {"TORCH_NCCL_ASYNC_ERROR_HANDLING": mode}
    assert nccl_env.check(env) == []
    assert nccl_env.effective(env)["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == (mode or "2")  # unset is torch's 3: set


def test_the_mode_is_read_at_the_boundary() -> None:
    assert environment.ProcessEnv.from_mapping({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}).nccl_error_handling == 2
    with pytest.raises(ConfigError, match="TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        environment.ProcessEnv.from_mapping({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "7"})


class WatchdogSawIt(FakeNccl):
    """A backend whose own watchdog saw a failure and aborted it (torch's error mode 2): its works report
    success, only ``get_error()`` says so."""

    def get_error(self) -> object:
        import torch._C._distributed_c10d as c10d
        return c10d.ErrorType.TIMEOUT


def test_a_step_on_a_communicator_torch_aborted_by_itself_counts_as_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    g = RebindableGroup(0, 2, [0, 1], timedelta(seconds=5))
    g.install(9, object(), [WatchdogSawIt()])  # type: ignore[arg-type]
    monkeypatch.setattr(groups, "groups", lambda: [g])
    monkeypatch.setattr(rebindable, "_broken_listeners", [])
    assert groups.collective_failed(9, settle_s=0.0)
    assert g.broken_generation == 9 and not groups.collective_failed(8, settle_s=0.0)
