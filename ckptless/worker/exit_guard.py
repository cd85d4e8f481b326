"""Exit safely while a retired mirror thread may still sit inside a native Gloo wait.

Why: after a recovery, the previous generation's mirror thread can be left
blocked in ``Work.wait`` on a peer that will never answer (Gloo point-to-point
work can be neither polled nor cancelled). If that wait returns while the
interpreter is finalizing (it does, as soon as the peer process exits and its
sockets close), Python unwinds the thread through C++ frames and the process
aborts (SIGABRT, "terminate called without an active exception"; reproduced
here with a core dump). So, at exit, if such a thread is still alive after a
short grace, the process leaves with ``os._exit`` and the exit code the program
asked for, after flushing its output. Before that, it declares the program's end
and its code (``worker/exit_file.py``): a teardown that still blocks (in an
earlier ``atexit`` hook, or a destructor at finalization) is bounded by its agent.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
from collections.abc import Callable
from types import TracebackType
from typing import Any, NoReturn

_installed = False
_exit_code = 0
_pending: list[Callable[[], bool]] = []  # each returns True while its thread is alive
_joins: list[Callable[[float], None]] = []


def watch(alive: Callable[[], bool], join: Callable[[float], None]) -> None:
    """Register a thread (by its liveness and join functions) to be guarded at exit."""
    _install()
    _pending.append(alive)
    _joins.append(join)


def install() -> None:
    """Guard the exit even before any thread is watched (the first engine thread comes later)."""
    _install()


_uncaught: list[Callable[[BaseException], None]] = []  # see on_uncaught


def on_uncaught(handler: Callable[[BaseException], None]) -> None:
    """Run ``handler(exc)`` for an exception nobody caught (e.g. raised in the script's setup,
    after ``ckptless.init()`` and before ``run()``), before Python prints it and exits 1."""
    _install()
    _uncaught.append(handler)


def set_exit_code(code: int) -> None:
    """The code the process is about to exit with (a ``SystemExit`` raised, not called, bypasses the hook)."""
    global _exit_code
    _install()
    _exit_code = code


def _install() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    previous_hook = sys.excepthook
    previous_exit = sys.exit

    def excepthook(t: type[BaseException], v: BaseException, tb: TracebackType | None) -> None:
        global _exit_code
        _exit_code = 1
        for handler in _uncaught:
            try:
                handler(v)
            except Exception:  # never let the record hide the user's traceback
                pass
        previous_hook(t, v, tb)

    def exit_(code: Any = 0) -> None:
        global _exit_code
        _exit_code = code if isinstance(code, int) else (0 if code is None else 1)
        previous_exit(code)

    sys.excepthook = excepthook
    sys.exit = exit_  # type: ignore[assignment]
    atexit.register(_guard)


def _guard(grace_s: float = 1.0) -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    # The program has ended: say so, with its code, before anything of the teardown can block (the
    # atexit hooks registered before ours, torch's and Gloo's destructors at finalization). A worker
    # stuck there in native code held its agent, and so the job, forever (issue 35); its agent now
    # ends it after --shutdown-timeout and records this code (launcher/watchdog.py).
    from ckptless.worker import exit_file  # deferred: this module is imported by the lowest layers

    exit_file.declare_end(_exit_code)
    _flush()  # what the program printed is out, whatever the teardown does next
    for join in _joins:
        join(grace_s / max(len(_joins), 1))
    if any(alive() for alive in _pending):
        leave_now(_exit_code)


def leave_now(code: int) -> NoReturn:
    """Exit at once with ``code``, after flushing output, without running anything else.

    For a process whose GPU failed: its CUDA context is poisoned, so what a normal exit runs (the
    script's ``finally`` blocks and context managers, torch's and NCCL's teardown at
    finalization) can raise again or hang on the dead device, and a process hung on its way out
    never has its exit recorded. How it ended is already in its exit file by then."""
    logging.shutdown()
    _flush()
    os._exit(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
