"""Leaving a generation never waits for a communicator's destructor (ckptless/worker/reaper.py).

Why: a broken Gloo group's destructor joins its worker threads, which can sit in a collective on a dead
peer until the collective timeout (or several times it); ProcessGroupNCCL's joins torch's watchdog. A
survivor's training thread sat 60-70 s in ``RebindableGroup.release`` (issue 35) while the leader waited
for its report. Here with stand-in backends whose destructors wait; a real Gloo group connecting to a dead
process: tests/e2e/test_leave_never_blocks.py.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from ckptless.worker import groups, reaper
from ckptless.worker.rebindable import RebindableGroup

class BlockingBackend:
    """Stands for a backend whose destructor waits (Gloo joining a stuck thread, NCCL its watchdog)."""

    def __init__(self, gate: threading.Event, log: list[str]) -> None:
        self.gate, self.log = gate, log

    def __del__(self) -> None:
        self.gate.wait(30)
        self.log.append(self.thread_name())

    thread_name = staticmethod(lambda: threading.current_thread().name)


def _release_in_thread(generation: int) -> tuple[threading.Thread, list[reaper.Release]]:
    out: list[reaper.Release] = []
    t = threading.Thread(target=lambda: out.append(groups.release_all(generation)), daemon=True)
    t.start()
    return t, out


def test_release_all_returns_while_a_destructor_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    gate, ran_on = threading.Event(), []
    g = RebindableGroup(0, 2, [0, 1], timedelta(seconds=5))
    g.install(11, object(), [BlockingBackend(gate, ran_on)])  # type: ignore[arg-type]
    monkeypatch.setattr(groups, "groups", lambda: [g])
    t, out = _release_in_thread(11)
    t.join(2.0)
    assert not t.is_alive(), "release_all waited for the communicator's destructor"
    assert not g.bound and ran_on == []
    rel = out[0]
    assert rel in reaper.running()
    gate.set()
    assert rel.thread is not None
    rel.thread.join(10)
    assert ran_on == ["ckptless-reaper-generation-11"] and rel.seconds is not None


def test_stuck_releases_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    gate, ran_on = threading.Event(), []
    monkeypatch.setattr(reaper, "MAX_PENDING", 2)
    rels = [reaper.drop(f"stuck {i}", [BlockingBackend(gate, ran_on)]) for i in range(3)]
    try:
        assert [r.leaked for r in rels] == [False, False, True]
        assert reaper.kept() >= 1 and len([r for r in reaper.running() if r in rels]) == 2
    finally:
        gate.set()
        for r in rels:
            if r.thread is not None:
                r.thread.join(10)
    assert len(ran_on) == 2  # the kept one stays referenced on purpose
    reaper._kept.clear()  # (the test's own: released here, not at interpreter exit)
