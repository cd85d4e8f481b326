"""Whether a pre-built spare's setup read its rank: such a setup is bound to its standby rank.

Why: a pre-built spare runs the script's setup as its standby rank while it
waits, and may later take another lost rank in place, with its objects as
built (``worker/adoption.py``). That is only right if the setup built the same
things for every rank. Nearly every script reads its rank during setup
(``rank = int(os.environ["RANK"])`` for a data shard, a per-rank seed, an
output file name), and a spare that took rank 2 with rank 0's setup trained on
rank 0's data (issue 17). So while a pre-built spare runs its setup, the ways
a script learns its rank are watched: the ``RANK``/``LOCAL_RANK``/``GROUP_RANK``
/``ROLE_RANK`` variables through ``os.environ``, ``torch.distributed.get_rank()``
and ``job.rank``. Reads from ckptless's or torch's own code are not the
script's and are ignored. A spare whose setup read its rank restarts as the
rank it is given (re-running the setup) instead of adopting it in place.

Only a pre-built spare is watched, only until its setup ends (``run()`` or
``steps()``), so no other process pays for it. What is not seen: a rank read
before ``ckptless.init()`` (it returns the standby rank, so the script would
not have been given another), ``from os import environ`` bound before the watch
started, and ``from torch.distributed import get_rank`` bound before it.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

import torch.distributed as dist

RANK_VARIABLES = frozenset({"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK"})
# Frames skipped on the way to the script's own: mapping plumbing, and stdlib code that copies the whole
# environment for a child (``subprocess.run`` in a setup reads every variable, RANK among them, without
# the script asking for its rank).
_INTERNAL = ("ckptless", "torch", "os", "_collections_abc", "collections", "importlib", "threading",
             "subprocess", "multiprocessing", "concurrent", "asyncio", "copy")

_lock = threading.Lock()
_reads: list[str] = []
_active = [False]
_saved: dict[str, Any] = {}


def _caller() -> str | None:
    """``file:line`` of the first frame outside ckptless, torch and the stdlib mapping code; None when
    the read came from ckptless or torch (not the script's)."""
    frame = sys._getframe(1)
    while frame is not None:
        module = str(frame.f_globals.get("__name__", ""))
        if module == __name__:
            frame = frame.f_back  # type: ignore[assignment]
            continue
        top = module.split(".", 1)[0]
        if top in ("ckptless", "torch"):
            return None
        if top not in _INTERNAL:
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return None


def note(what: str) -> None:
    """Record a rank read by the script (called by the watched accessors)."""
    if not _active[0]:
        return
    where = _caller()
    if where is not None:
        entry = f"{what} at {where}"
        with _lock:
            if len(_reads) < 16 and entry not in _reads:
                _reads.append(entry)


_copying = threading.local()


class _WatchedEnviron(os._Environ):
    def __getitem__(self, key: str) -> str:
        if key in RANK_VARIABLES and not getattr(_copying, "on", False):
            note(f"os.environ[{key!r}]")
        return str(super().__getitem__(key))

    def copy(self) -> dict[str, str]:
        """A copy of the whole environment (for a child process) asks for no rank."""
        _copying.on = True
        try:
            return dict(self)
        finally:
            _copying.on = False


def _watched_get_rank(*args: Any, **kwargs: Any) -> int:
    note("torch.distributed.get_rank()")
    return int(_saved["get_rank"](*args, **kwargs))


def start() -> None:
    """Watch the script's rank reads from now on (a pre-built spare, before its setup)."""
    with _lock:
        if _active[0]:
            return
        _reads.clear()
        _saved["environ_class"] = os.environ.__class__
        _saved["get_rank"] = dist.get_rank
        os.environ.__class__ = _WatchedEnviron
        dist.get_rank = _watched_get_rank
        _active[0] = True


def stop() -> list[str]:
    """Stop watching (the setup ended); returns the reads seen."""
    with _lock:
        if _active[0]:
            os.environ.__class__ = _saved["environ_class"]
            dist.get_rank = _saved["get_rank"]
            _active[0] = False
        return list(_reads)


def reads() -> list[str]:
    """The script's rank reads seen during its setup (``"os.environ['RANK'] at train.py:12"``, ...)."""
    with _lock:
        return list(_reads)
