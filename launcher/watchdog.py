"""The agent's hang watchdog: SIGKILL a local worker whose heartbeat stalled, or whose teardown outlives
its program's end.

Why: a frozen process (SIGSTOP, a native call holding the GIL) breaks no
connection, so its peers would only notice at the collective timeout. Killed,
it becomes the crash case the survivors detect in milliseconds. The heartbeat
comes from a thread in the worker (``ckptless/worker/heartbeat.py``): a rank
blocked in a collective on a hung peer keeps beating and is left alone.

A worker whose program ended (it said so, with its exit code, from its exit
guard's ``atexit`` hook: ``worker/exit_file.py``) but whose process is still
there ``--shutdown-timeout`` seconds later is stuck in its teardown (an
earlier ``atexit`` hook, a destructor at finalization waiting in native code
on a peer that is gone): its agent would wait for it forever, and with it
the job (issue 35: a job that lost its leader's node hung after every rank
had written its final state). It is killed, and its exit is recorded with
the code its program ended with (launcher/exit_records.py).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping

from ckptless.launcher.slots import SlotTable
from ckptless.launcher.workers import WorkerGroup
from ckptless.worker import exit_file
from ckptless.worker.heartbeat import read_progress

log = logging.getLogger("ckptless.agent")


def startup_grace_s(hang_timeout: float) -> float:
    """How long a worker that has not trained a step yet may go without a heartbeat.

    Why longer than the hang timeout: before its first step a process imports
    modules and builds the script's objects, and on a loaded host C extensions
    can hold the GIL for seconds (two fresh respawns were killed as frozen at
    load 20 in the long chaos run before this).
    """
    return max(4.0 * hang_timeout, 60.0)


def starting(heartbeat_file: str) -> bool:
    """Has the worker behind this heartbeat not trained a step yet?"""
    doc = read_progress(heartbeat_file)
    return doc is not None and doc.get("state") == "starting"


def watch_hangs(timeout: float | None, slots: SlotTable, group: Callable[[], WorkerGroup | None],
                stopping: threading.Event) -> None:
    """Until ``stopping``: SIGKILL a rank whose heartbeat is older than ``timeout``; one that has not
    trained a step yet (a fresh respawn or spare in its setup) gets :func:`startup_grace_s` instead,
    so a slow start on a busy host is not taken for a hang."""
    if not timeout:
        return
    while not stopping.wait(min(timeout / 4, 0.25)):
        g = group()
        if g is None:
            continue
        now = time.time()
        for slot in slots.all():
            if not slot.alive or slot.rank is None:
                continue
            try:
                age = now - os.stat(slot.heartbeat_file).st_mtime
            except FileNotFoundError:
                continue  # not started yet (a respawn's predecessor's file is removed)
            if age <= timeout or (starting(slot.heartbeat_file) and age <= startup_grace_s(timeout)):
                continue
            log.error("rank %d (%s) is frozen (no heartbeat for %.1fs): SIGKILL", slot.rank, slot.worker_id, age)
            g.send_signal(slot.local_rank, signal.SIGKILL)
            os.utime(slot.heartbeat_file)


def stuck_in_teardown(pids: Mapping[int, int], exit_path: Callable[[int], str], grace_s: float,
                      now: float) -> list[tuple[int, int, int, float]]:
    """``(local rank, pid, code, seconds since)`` of each live worker whose program declared its end
    with ``code`` more than ``grace_s`` ago (wall clock: the worker wrote the time)."""
    out = []
    for lr, pid in sorted(pids.items()):
        end = exit_file.read_end(exit_path(lr), pid)
        if end is not None and now - end[1] > grace_s:
            out.append((lr, pid, end[0], now - end[1]))
    return out


def end_stuck_teardowns(group: WorkerGroup, exit_path: Callable[[int], str], grace_s: float,
                        killed: set[int]) -> None:
    """SIGKILL each worker stuck in its teardown (see the module doc), once, with one line; ``killed``
    keeps their pids: the exit recorder records the code each declared instead of the signal."""
    for lr, pid, code, since in stuck_in_teardown(group.pids(), exit_path, grace_s, time.time()):
        if pid in killed:
            continue
        killed.add(pid)
        log.error("local rank %d (pid %d) ended its program with code %d %.0fs ago and is still in its teardown "
                  "(an atexit hook or a destructor at exit, --shutdown-timeout %.0fs): SIGKILL; its exit is "
                  "recorded as code %d", lr, pid, code, since, grace_s, code)
        group.send_signal(lr, signal.SIGKILL)
