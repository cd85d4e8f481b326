"""The emulation processes of bench/control_plane.py, seen from the driver: start, command, hear, stop.

Each process (bench/_control_plane_node.py) holds a contiguous slice of the nodes. It answers in
JSON lines on its stdout; one reader thread per process puts them in a queue, so every wait here has
a deadline and a process that dies is noticed (its EOF arrives as ``{"msg": "eof"}``).
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from _recovery_common import kill_group

NODE = str(Path(__file__).resolve().parent / "_control_plane_node.py")
REPO = Path(__file__).resolve().parents[1]


def _die_with_parent() -> Callable[[], None]:
    """PR_SET_PDEATHSIG(SIGKILL): an emulation process never outlives the driver."""
    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def preexec() -> None:
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)

    return preexec


def split(n_nodes: int, procs: int) -> list[tuple[int, int]]:
    """``procs`` contiguous node ranges, sizes within one."""
    procs = max(1, min(procs, n_nodes))
    base, extra = divmod(n_nodes, procs)
    out, start = [], 0
    for i in range(procs):
        size = base + (1 if i < extra else 0)
        out.append((start, start + size))
        start += size
    return out


class Emulators:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = str(REPO) + os.pathsep + self.env.get("PYTHONPATH", "")
        self.env.setdefault("OMP_NUM_THREADS", "1")
        self.procs: list[subprocess.Popen[str]] = []
        self.queues: list[queue.Queue[dict[str, Any]]] = []
        self.backlog: list[list[dict[str, Any]]] = []
        self._logs: list[IO[bytes]] = []

    def start(self, args: list[list[str]]) -> list[int]:
        """Start one process per argument list; their indices."""
        out = []
        for extra in args:
            i = len(self.procs)
            err = open(self.log_dir / f"emulator{i}.log", "wb")
            self._logs.append(err)
            p = subprocess.Popen([sys.executable, NODE, *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=err, text=True, env=self.env, start_new_session=True,
                                 preexec_fn=_die_with_parent())  # noqa: PLW1509 - prctl only
            self.procs.append(p)
            q: queue.Queue[dict[str, Any]] = queue.Queue()
            self.queues.append(q)
            self.backlog.append([])
            threading.Thread(target=self._read, args=(p, q), name=f"bench-read{i}", daemon=True).start()
            out.append(i)
        return out

    @staticmethod
    def _read(p: subprocess.Popen[str], q: queue.Queue[dict[str, Any]]) -> None:
        assert p.stdout is not None
        for line in p.stdout:
            try:
                q.put(json.loads(line))
            except ValueError:
                q.put({"msg": "noise", "line": line[:300]})
        q.put({"msg": "eof"})

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def send(self, cmd: str, which: list[int] | None = None) -> None:
        for i in range(len(self.procs)) if which is None else which:
            stdin = self.procs[i].stdin
            assert stdin is not None
            stdin.write(cmd + "\n")
            stdin.flush()

    def expect(self, msg: str, deadline: float, which: list[int] | None = None) -> list[dict[str, Any]]:
        """The next ``msg`` line of each process (in process order); raises at the deadline or on an EOF.
        Lines of other kinds stay in the process's backlog for a later ``expect``."""
        out = []
        for i in range(len(self.procs)) if which is None else which:
            hit = next((d for d in self.backlog[i] if d["msg"] == msg), None)
            while hit is None:
                try:
                    doc = self.queues[i].get(timeout=max(0.001, deadline - time.monotonic()))
                except queue.Empty:
                    raise TimeoutError(f"emulation process {i} did not say {msg!r} in time") from None
                if doc["msg"] == "eof":
                    raise RuntimeError(f"emulation process {i} ended (rc={self.procs[i].poll()}) before {msg!r}; "
                                       "see its log in the work directory")
                if doc["msg"] == msg:
                    hit = doc
                else:
                    self.backlog[i].append(doc)
            if hit in self.backlog[i]:
                self.backlog[i].remove(hit)
            out.append(hit)
        return out

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask each process to leave, then SIGKILL whatever is left (its process group)."""
        for p in self.procs:
            try:
                if p.stdin is not None:
                    p.stdin.write("exit\n")
                    p.stdin.close()
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            kill_group(p)
        for f in self._logs:
            f.close()
