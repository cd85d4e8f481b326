"""How a worker ended, in its own words: a typed JSON file its agent reads after the reap.

Why a file and not the exit code: an exit code cannot say *why* (a user's
``ValueError``, a fault ckptless could not handle, a worker the coordinator
fenced out), and the difference decides between failing the job fast and
recovering. The agent points ``CKPTLESS_EXIT_FILE`` at a per-slot path,
removes it before each (re)spawn, and copies what it finds into the exit
record in etcd (``ckptless.recovery.view.ExitRecord``). A worker killed by a
signal writes nothing, which is itself the fact: a fault.

Beside it, ``<file>.end`` says that the program itself ended, with which
code (:func:`declare_end`, from the exit guard's ``atexit`` hook): what is
left is the interpreter's teardown. The agent bounds how long a process that
said so may take to go (launcher/watchdog.py), and records a process it had
to kill there with the code it declared.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from typing import Any

from ckptless import environment
from ckptless.recovery import EXIT_KINDS, MAX_TRACEBACK_CHARS, ErrorSummary, ExitKind


def summarize(exc: BaseException) -> ErrorSummary:
    """Type, message and the tail of the traceback (what torchrun's error summary shows)."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return ErrorSummary(type(exc).__qualname__, str(exc), tb[-MAX_TRACEBACK_CHARS:])


def write(kind: ExitKind, error: ErrorSummary | None = None, path: str | None = None) -> None:
    """Record how this worker is about to end (best effort: never raises)."""
    target = path if path is not None else environment.current().exit_file
    if not target:
        return
    doc: dict[str, Any] = {"kind": kind, "pid": os.getpid(), "error": None if error is None else error.to_doc()}
    tmp = f"{target}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, target)
    except OSError:
        pass


def written() -> bool:
    """Has this process already recorded how it ends (a record with its own pid)?"""
    target = environment.current().exit_file
    if not target:
        return False
    kind, _ = read(target, pid=os.getpid())
    return kind is not None


def read(path: str, pid: int | None = None) -> tuple[ExitKind | None, ErrorSummary | None]:
    """What the worker wrote (``(None, None)`` if nothing usable, or if it names another process)."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None, None
    if not isinstance(doc, dict) or doc.get("kind") not in EXIT_KINDS:
        return None, None
    if pid is not None and doc.get("pid") not in (None, pid):
        return None, None
    kind: ExitKind = doc["kind"]
    return kind, ErrorSummary.from_doc(doc.get("error"))


def end_path(path: str) -> str:
    return f"{path}.end"


def declare_end(code: int, path: str | None = None) -> None:
    """This process's program ended with ``code``; only the interpreter's teardown is left (best effort)."""
    target = path if path is not None else environment.current().exit_file
    if not target:
        return
    tmp = f"{end_path(target)}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump({"pid": os.getpid(), "code": int(code), "t": time.time()}, f)
        os.replace(tmp, end_path(target))
    except OSError:
        pass


def read_end(path: str, pid: int) -> tuple[int, float] | None:
    """``(code, wall time)`` the process ``pid`` declared when its program ended, or None."""
    try:
        with open(end_path(path)) as f:
            doc = json.load(f)
        if doc.get("pid") == pid and isinstance(doc.get("code"), int):
            return int(doc["code"]), float(doc["t"])
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        pass
    return None


def clear(path: str) -> None:
    for p in (path, f"{path}.tmp", end_path(path), f"{end_path(path)}.tmp"):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass
