"""Progress heartbeat read by the agent's hang detector.

Why a file and not etcd: it is written every step, so it must cost
microseconds; the agent on the same node only needs the file's mtime. A
worker that stops updating it for ``--hang-timeout`` seconds (SIGSTOP, a
deadlock, a stuck collective) is SIGKILLed by its agent, which turns a hang
into the crash case that Gloo's survivors detect in milliseconds.
"""

from __future__ import annotations

import os


class Heartbeat:
    def __init__(self, path: str | None) -> None:
        self._fd: int | None = None
        if path:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)

    def beat(self, step: int = 0) -> None:
        if self._fd is not None:
            os.pwrite(self._fd, f"{step:>20}\n".encode(), 0)  # updates mtime; no allocation, no flush needed

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
