"""A worker's declared end and the agent's bound on its teardown (worker/exit_file.py, launcher/watchdog.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from ckptless.launcher.watchdog import stuck_in_teardown
from ckptless.worker import exit_file


def test_declared_end_is_read_back_for_its_own_pid_only(tmp_path: Path) -> None:
    path = str(tmp_path / "exit0.json")
    exit_file.declare_end(3, path)
    end = exit_file.read_end(path, os.getpid())
    assert end is not None and end[0] == 3 and abs(end[1] - time.time()) < 60
    assert exit_file.read_end(path, os.getpid() + 1) is None, "another incarnation's declaration"
    exit_file.clear(path)
    assert exit_file.read_end(path, os.getpid()) is None, "a respawn clears it"


def test_only_a_worker_past_the_grace_since_its_declared_end_is_stuck(tmp_path: Path) -> None:
    paths = {lr: str(tmp_path / f"exit{lr}.json") for lr in range(3)}
    exit_file.declare_end(0, paths[0])
    exit_file.declare_end(1, paths[1])
    me = os.getpid()
    now = time.time()
    pids = {0: me, 1: me, 2: me}  # 2 declared nothing: still running its program
    assert stuck_in_teardown(pids, paths.__getitem__, 30.0, now) == []
    later = stuck_in_teardown(pids, paths.__getitem__, 30.0, now + 31.0)
    assert [(lr, pid, code) for lr, pid, code, _ in later] == [(0, me, 0), (1, me, 1)]
    assert stuck_in_teardown({0: me + 1}, paths.__getitem__, 30.0, now + 31.0) == [], "another pid's file"
