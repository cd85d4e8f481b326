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
script's and are ignored, and so are whole copies and walks of the environment
(``os.environ.copy()`` for a child; ``os.environ.items()``: tqdm, which torch
imports, scans every variable at import), which ask for no rank. A spare whose
setup read its rank restarts as the rank it is given (re-running the setup)
instead of adopting it in place.

Only a spare is watched, only until its setup ends (``run()`` or ``steps()``),
so no other process pays for it. Its environment is watched from its first
line, before the script runs: ``ckptless-run`` starts it with
:mod:`ckptless.worker.spare_site` on its ``PYTHONPATH`` (a cold start) and its
fork server calls :func:`at_process_start` in a warm one. A rank read before
``ckptless.init()`` is the common case (``rank = int(os.environ["RANK"])`` at
the top of ``main()``, or a module-level constant): it returns the standby rank
(a pre-built spare) or the placeholder ``0`` (a spare that waits in ``init()``
for its rank, ``--no-spare-prebuild``), and such spares took other ranks with
that rank's data and seeds: the job ended exit 0 and wrong (issue 35). A spare
that read its rank, or whose start was not watched (another launcher,
``python -S``: :func:`watched_from_start`), restarts as the rank it is given
(``worker/adoption.py``). What is still not seen: ``from torch.distributed import
get_rank`` bound before ``init()`` (before ``init()`` no default group exists,
so it cannot answer a rank there anyway), and a rank that reaches the script
by another way than these variables and calls (a file it wrote, its argv).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

RANK_VARIABLES = frozenset({"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK"})
# Frames skipped on the way to the script's own: mapping plumbing, and stdlib code that copies the whole
# environment for a child (``subprocess.run`` in a setup reads every variable, RANK among them, without
# the script asking for its rank).
_INTERNAL = ("ckptless", "torch", "os", "_collections_abc", "collections", "importlib", "threading",
             "subprocess", "multiprocessing", "concurrent", "asyncio", "copy")

_lock = threading.Lock()
_reads: list[str] = []
_active = [False]  # os.environ is watched
_from_start = [False]  # ... since before the script's first line (at_process_start)
_get_rank_watched = [False]
_saved: dict[str, Any] = {}  # kept once saved: a setup may hold _watched_get_rank after stop()
# When the watched setup's parts began and ended (time.monotonic), for the notice a spare gives at start
# (worker/setup_notice.py): "start" the process (its exec, or its fork from the fork server), "init" the
# script's call of ckptless.init(), "built" its return, "end" the setup's end (stop()); "reads_before_init"
# how many of the reads came before init(); "warm" whether the fork server started the process.
_times: dict[str, float] = {}
_modules: dict[str, frozenset[str]] = {}  # top-level modules loaded at the process's start ("start"), at init ("init")


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
        if module in ("_collections_abc", "collections.abc") and frame.f_code.co_name == "__iter__":
            return None  # os.environ.items()/.values() walking every variable (tqdm's settings scan at import)
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


def spare(env: Mapping[str, str]) -> bool:
    """Whether a process started with ``env`` is a spare: its ``RANK`` names a rank it may not take (its
    standby rank if pre-built, a placeholder if it waits in ``ckptless.init()``)."""
    return env.get("CKPTLESS_ROLE") == "spare"


def at_process_start(env: Mapping[str, str] | None = None) -> bool:
    """Before the script's first line (:mod:`ckptless.worker.spare_site`, or the fork server's new
    worker with the ``env`` its agent built): a spare's environment is watched from here on. Anything
    inherited is dropped first (a forked worker's server may have watched itself). Imports no torch:
    it runs before the script, which may set what torch reads at import. True if watching."""
    stop()
    with _lock:
        _reads.clear()
        _times.clear()
        _modules.clear()
        _from_start[0] = False
    if not spare(os.environ if env is None else env):
        return False
    _times.update(start=time.monotonic() - _process_age(), warm=float(env is not None))
    _modules["start"] = _top_modules()
    _watch_environ()
    _from_start[0] = True
    return True


def _top_modules() -> frozenset[str]:
    return frozenset(name.partition(".")[0] for name in list(sys.modules))


def imported_before_init() -> list[str]:
    """Top-level modules the script imported between the process's start and ``ckptless.init()``
    (what a restart imports again unless the fork server preloads them: ``CKPTLESS_PRELOAD``)."""
    with _lock:
        if "start" not in _modules or "init" not in _modules:
            return []
        return sorted(_modules["init"] - _modules["start"])


def _process_age() -> float:
    """Seconds since this process began (its exec or fork): what ran before :func:`at_process_start`
    (the interpreter's own start) counts as setup too. /proc's start time is in clock ticks since boot
    (10 ms); 0.0 where it cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return 0.0


def watched_from_start() -> bool:
    """Whether every rank read of this process's script could be seen (see :func:`at_process_start`)."""
    return _from_start[0]


def _watch_environ() -> None:
    with _lock:
        if not _active[0]:
            _reads.clear()
            _saved["environ_class"] = os.environ.__class__
            os.environ.__class__ = _WatchedEnviron
            _active[0] = True


def start(init_called: float | None = None) -> None:
    """Watch the script's rank reads from now on (a pre-built spare, before its setup); the reads seen
    since :func:`at_process_start` are kept, and ``torch.distributed.get_rank`` is watched from here.
    ``init_called``: when the script called ``ckptless.init()`` (this runs as it returns)."""
    import torch.distributed as dist  # here: at_process_start runs before the script imports torch

    _watch_environ()
    with _lock:
        now = time.monotonic()
        _times.update(init=now if init_called is None else init_called, built=now,
                      reads_before_init=float(len(_reads)))
        _modules.setdefault("init", _top_modules())
        if not _get_rank_watched[0]:
            _saved["get_rank"] = dist.get_rank
            dist.get_rank = _watched_get_rank
            _get_rank_watched[0] = True


def stop() -> list[str]:
    """Stop watching (the setup ended); returns the reads seen."""
    with _lock:
        if _active[0]:
            os.environ.__class__ = _saved.pop("environ_class")
            _active[0] = False
            _times.setdefault("end", time.monotonic())
        if _get_rank_watched[0]:
            import torch.distributed as dist

            dist.get_rank = _saved["get_rank"]
            _get_rank_watched[0] = False
        return list(_reads)


def setup_times() -> dict[str, float]:
    """The watched setup's timestamps (see ``_times``); empty where nothing was watched."""
    with _lock:
        return dict(_times)


def reads() -> list[str]:
    """The script's rank reads seen during its setup (``"os.environ['RANK'] at train.py:12"``, ...)."""
    with _lock:
        return list(_reads)
