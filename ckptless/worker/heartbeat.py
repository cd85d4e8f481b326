"""Liveness heartbeat read by the agent's hang detector.

Why a file and a thread: the agent on the same node only needs the file's
mtime, so a beat costs one ``pwrite``. The beat comes from a small background
thread, not from the training step: ranks blocked in a collective waiting for
a hung peer must keep beating (they are fine), while a frozen process (SIGSTOP,
a stuck driver call holding the GIL) stops beating altogether. The agent
SIGKILLs a rank whose file is older than ``--hang-timeout``, which turns the
hang into the crash case that Gloo's survivors detect in milliseconds. The file
also carries a one-line JSON progress record (step, committed version,
generation, replica bytes held, state) that the agent exports as metrics:
node-local, so progress costs no etcd write.
"""

from __future__ import annotations

import json
import logging
import os
import threading


class Heartbeat:
    def __init__(self, path: str | None, interval_s: float = 0.25) -> None:
        self._path = path
        self._fd: int | None = None
        self._doc: dict[str, object] = {"state": "starting"}
        self._text = self._encode()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # the thread's beat and a state change's immediate write
        if path:
            try:
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
            except OSError as exc:  # no heartbeat is better than no training: the agent then never judges us
                logging.getLogger(__name__).warning("heartbeat file %s unusable (%s): hang detection off", path, exc)
                return
            self._write()
            self._thread = threading.Thread(target=self._run, args=(interval_s,), name="ckptless-heartbeat", daemon=True)
            self._thread.start()

    def _encode(self) -> bytes:
        return (json.dumps(self._doc, separators=(",", ":")) + "\n").encode()

    def _write(self) -> None:
        with self._lock:
            fd = self._fd
            if fd is not None:
                text = self._text
                try:
                    os.pwrite(fd, text, 0)  # updates the mtime; no allocation, no flush needed
                    os.ftruncate(fd, len(text))
                except OSError:
                    pass

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self._write()

    def beat(self, step: int = 0, **progress: object) -> None:
        """Record progress (the thread keeps the file fresh in between).

        A change of state is written at once: the agent judges a "starting" worker with a long
        start-up grace, so a rank frozen within one beat interval of its first step (fast steps)
        was given 60 s instead of ``--hang-timeout`` (seen in CI: a 2 s hang test took 74 s).
        """
        changed = self._doc.get("state") != "training"
        self._doc = {**self._doc, **progress, "state": "training", "step": step}
        self._text = self._encode()
        if changed:
            self._write()

    def recovering(self) -> None:
        self._doc = {**self._doc, "state": "recovering"}
        self._text = self._encode()
        self._write()


    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
            try:  # a finishing process is not a frozen one: the agent stops judging it
                os.unlink(self._path or "")
            except OSError:
                pass


def read_progress(path: str) -> dict[str, object] | None:
    """The progress record a worker's heartbeat file holds (None if absent or mid-write)."""
    try:
        with open(path) as f:
            doc = json.loads(f.readline())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None
