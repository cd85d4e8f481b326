"""Liveness heartbeat read by the agent's hang detector.

Why a file and a thread: the agent on the same node only needs the file's
mtime, so a beat costs one ``pwrite``. The beat comes from a small background
thread, not from the training step: ranks blocked in a collective waiting for
a hung peer must keep beating (they are fine), while a frozen process (SIGSTOP,
a stuck driver call holding the GIL) stops beating altogether. The agent
SIGKILLs a rank whose file is older than ``--hang-timeout``, which turns the
hang into the crash case that Gloo's survivors detect in milliseconds. The file
also carries the last completed step (or ``recovering``) for humans.
"""

from __future__ import annotations

import logging
import os
import threading


class Heartbeat:
    def __init__(self, path: str | None, interval_s: float = 0.25) -> None:
        self._path = path
        self._fd: int | None = None
        self._text = f"{'starting':>20}\n".encode()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if path:
            try:
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            except OSError as exc:  # no heartbeat is better than no training: the agent then never judges us
                logging.getLogger(__name__).warning("heartbeat file %s unusable (%s): hang detection off", path, exc)
                return
            self._write()
            self._thread = threading.Thread(target=self._run, args=(interval_s,), name="ckptless-heartbeat", daemon=True)
            self._thread.start()

    def _write(self) -> None:
        fd = self._fd
        if fd is not None:
            try:
                os.pwrite(fd, self._text, 0)  # updates the mtime; no allocation, no flush needed
            except OSError:
                pass

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self._write()

    def beat(self, step: int = 0) -> None:
        """Record progress (the thread keeps the file fresh in between)."""
        self._text = f"{step:>20}\n".encode()

    def recovering(self) -> None:
        self._text = f"{'recovering':>20}\n".encode()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            try:  # a finishing process is not a frozen one: the agent stops judging it
                os.unlink(self._path or "")
            except OSError:
                pass
