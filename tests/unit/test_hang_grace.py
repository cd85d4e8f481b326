"""The hang watchdog's start-up grace: a worker that has not trained a step yet is not taken for
a frozen one after ``--hang-timeout`` (a respawn's setup on a busy host), only after the grace."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ckptless.launcher.watchdog import starting as _starting
from ckptless.launcher.watchdog import startup_grace_s
from ckptless.worker.heartbeat import Heartbeat, read_progress


def test_grace_is_longer_than_the_timeout_and_at_least_a_minute() -> None:
    assert startup_grace_s(5.0) == 60.0
    assert startup_grace_s(30.0) == 120.0
    assert all(startup_grace_s(t) > t for t in (0.5, 5.0, 100.0))


def test_starting_until_the_first_step(tmp_path: Path) -> None:
    path = tmp_path / "hb"
    hb = Heartbeat(str(path), interval_s=0.01)  # the thread writes what beat() recorded
    try:
        assert _starting(str(path))
        hb.beat(1, generation=0, committed=None, replica_bytes=0)
        _wait_for_state(path, "training")
        assert not _starting(str(path))
        hb.recovering()
        _wait_for_state(path, "recovering")
        assert not _starting(str(path))
    finally:
        hb.close()


def _wait_for_state(path: Path, state: str) -> None:
    """The beat thread writes every 10 ms: wait for that write (an event, bounded), not a duration."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        doc = read_progress(str(path))
        if doc is not None and doc.get("state") == state:
            return
        time.sleep(0.005)
    raise AssertionError(f"heartbeat never showed state {state!r}")


def test_missing_or_torn_file_is_not_starting(tmp_path: Path) -> None:
    assert not _starting(str(tmp_path / "absent"))
    (tmp_path / "torn").write_text('{"state": "star')
    assert not _starting(str(tmp_path / "torn"))
    (tmp_path / "ok").write_text(json.dumps({"state": "starting"}) + "\n")
    assert _starting(str(tmp_path / "ok"))


def test_first_beat_reaches_the_file_at_once(tmp_path: Path) -> None:
    """A state change is written immediately, not at the thread's next tick: a rank frozen right after
    its first (fast) steps must be judged as training, not given the start-up grace (found in CI, where
    the 2 s hang test took 74 s when the SIGSTOP landed within one beat interval)."""
    from ckptless.launcher.watchdog import starting
    from ckptless.worker.heartbeat import Heartbeat, read_progress

    path = str(tmp_path / "hb")
    hb = Heartbeat(path, interval_s=3600.0)  # the thread never ticks during this test
    try:
        assert starting(path)
        hb.beat(1, generation=0)
        assert not starting(path) and read_progress(path) == {"state": "training", "step": 1, "generation": 0}
        hb.recovering()
        assert read_progress(path)["state"] == "recovering"  # type: ignore[index]
    finally:
        hb.close()
