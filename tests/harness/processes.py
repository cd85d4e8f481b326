"""Synchronising with real processes without sleeps: a FIFO to read lines from, an exit recorder, and
liveness checks on pids (``/proc`` and pidfds). Used by the WorkerGroup and fork-server tests."""

from __future__ import annotations

import os
import select
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ckptless.launcher.worker_process import WorkerExit

TIMEOUT = 20.0


class Fifo:
    """A named pipe the test reads lines from; workers open it by path and write."""

    def __init__(self, path: Path) -> None:
        os.mkfifo(path)
        self.path = str(path)
        self.fd = os.open(path, os.O_RDWR | os.O_NONBLOCK)  # we are a writer too: never EOF
        self.buf = b""

    def line(self, timeout: float = TIMEOUT) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise TimeoutError(f"no line on {self.path} within {timeout}s")
            self.buf += os.read(self.fd, 4096)
        head, self.buf = self.buf.split(b"\n", 1)
        return head.decode()

    def close(self) -> None:
        os.close(self.fd)


class Recorder:
    """on_exit callback: remembers exits and when it was called."""

    def __init__(self) -> None:
        self.exits: list[tuple[WorkerExit, float]] = []
        self.cond = threading.Condition()

    def __call__(self, ex: WorkerExit) -> None:
        with self.cond:
            self.exits.append((ex, time.monotonic()))
            self.cond.notify_all()

    def wait_for(self, n: int, timeout: float = TIMEOUT) -> list[tuple[WorkerExit, float]]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.exits) >= n, timeout), f"only {len(self.exits)} exits"
            return list(self.exits)


def alive(pid: int) -> bool:
    """True unless the pid is gone or a zombie (an unreaped zombie is dead for our purposes)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # ESRCH: reaped between open and read
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def wait_dead(pid: int, timeout: float) -> bool:
    """Block (on a pidfd) until ``pid`` dies; False if it is alive after ``timeout``."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        select.select([pidfd], [], [], timeout)
    finally:
        os.close(pidfd)
    return not alive(pid)
