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
