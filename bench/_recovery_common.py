"""Plumbing that both sides of bench/recovery.py share: where the worker is, the environment its
launchers get, waiting on a worker's files, stopping a launcher's process group, and reading the
goodput ledgers.

Why its own module: the ckptless runs (:mod:`_recovery_ckptless`) and the torchrun + DCP runs
(:mod:`_recovery_torchrun`) start, watch and stop their jobs the same way; one copy keeps the two
measurements comparable.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ckptless import environment

REPO = Path(__file__).resolve().parent.parent
WORKER = str(REPO / "bench" / "_recovery_worker.py")
PY = sys.executable
MIB = 1 << 20


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(environment.environ())
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def wait_file(path: Path, timeout: float, procs: list[subprocess.Popen[bytes]]) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            try:
                return json.loads(path.read_text())
            except ValueError:
                pass
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            args = dead[0].args
            shown = list(args[:3]) if isinstance(args, (list, tuple)) else [args]
            raise RuntimeError(f"a launcher exited ({shown!r}... rc={dead[0].returncode}) while waiting for {path}")
        time.sleep(0.01)
    raise TimeoutError(f"{path} did not appear within {timeout}s")


def kill_group(p: subprocess.Popen[Any]) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait(10)


def settle_s(nbytes: int, world: int) -> float:
    """Time for the last mirror round / writes to finish before the kill (CPUs quiet)."""
    return 1.0 + nbytes * world / 4 / 200e6


class EventTail:
    """The ranks' ledger events so far, read incrementally: each poll reads only the bytes appended
    since the last one. Why: re-reading every rank's whole ledger every 20 ms took ~2.3 ms of CPU per
    poll at W = 32 here, a bench loop stealing ~10 % of a core from the 32 processes it measures
    (and 8x less at W = 4): the observer skewed the W ratio it observes (issue 35)."""

    def __init__(self, gdir: Path) -> None:
        self.gdir = gdir
        self.events: list[dict[str, Any]] = []
        self._offsets: dict[Path, int] = {}

    def poll(self) -> list[dict[str, Any]]:
        for f in sorted(self.gdir.glob("rank*.jsonl")):
            at = self._offsets.get(f, 0)
            with open(f, "rb") as fh:
                fh.seek(at)
                data = fh.read()
            end = data.rfind(b"\n") + 1  # complete lines only: a line being written is read next time
            for line in data[:end].splitlines():
                if line.strip():
                    self.events.append(json.loads(line))
            self._offsets[f] = at + end
        return self.events


def read_events(gdir: Path) -> list[dict[str, Any]]:
    """Every complete event the ranks' ledgers hold now."""
    return EventTail(gdir).poll()
