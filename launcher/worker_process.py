"""One worker process as the agent holds it: tied to the agent's life, signalled as a group, its end.

Why a module of its own: these are the kernel-level guarantees that no worker
outlives its agent or leaves orphans, whichever way it was started (cold
Popen, or forked by the warm fork server):

* every worker runs in its own session (``start_new_session``), so signals
  and kills address its whole process group, grandchildren included, and a
  Ctrl-C on the agent's terminal reaches workers only through the agent.
* ``PR_SET_PDEATHSIG(SIGKILL)`` makes the kernel kill a worker whose agent
  was SIGKILLed.  The kernel ties it to the *thread* that forked, so all
  spawns go through one long-lived spawner thread: a worker started from a
  short-lived thread would be killed when that thread ends.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

_PR_SET_PDEATHSIG = 1


class ProcessHandle(Protocol):
    """What the reaper needs of a worker: Popen, or a WarmChild from the fork server."""

    @property
    def pid(self) -> int: ...

    def wait(self, timeout: float | None = None) -> int: ...


@dataclass(frozen=True)
class WorkerExit:
    """One worker incarnation's end, as the reaper saw it."""

    local_rank: int
    pid: int
    incarnation: int  # 0 for the first spawn, +1 per respawn
    exitcode: int | None  # set when the process exited
    signal: int | None  # set when a signal killed it
    monotonic: float  # time.monotonic() when the reaper woke
    wall: float  # time.time() at the same moment
    requested: bool  # True when our stop() (or kill during stop) caused it

    @property
    def returncode(self) -> int:
        """Popen convention: exit code, or minus the signal number."""
        return -self.signal if self.signal is not None else int(self.exitcode or 0)

    @property
    def ok(self) -> bool:
        return self.exitcode == 0

    succeeded = ok


def pdeathsig_preexec(parent_pid: int) -> Callable[[], None] | None:
    """A preexec_fn setting PR_SET_PDEATHSIG=SIGKILL (Linux only; bound before fork)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    sigkill = int(signal.SIGKILL)

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
        if os.getppid() != parent_pid:  # the agent died before prctl took effect
            os.kill(os.getpid(), sigkill)

    return preexec


_spawner_lock = threading.Lock()
_spawner: ThreadPoolExecutor | None = None


def spawn_thread() -> ThreadPoolExecutor:
    """The process-wide spawner thread (see module docstring: PDEATHSIG is per thread)."""
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptless-spawner")
        return _spawner


def killpg(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return kill(pgid, sig)


def kill(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False
