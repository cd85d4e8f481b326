"""The agent's hang watchdog: SIGKILL a local worker whose heartbeat stalled.

Why: a frozen process (SIGSTOP, a native call holding the GIL) breaks no
connection, so its peers would only notice at the collective timeout. Killed,
it becomes the crash case the survivors detect in milliseconds. The heartbeat
comes from a thread in the worker (``ckptless/worker/heartbeat.py``): a rank
blocked in a collective on a hung peer keeps beating and is left alone.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

from ckptless.launcher.slots import SlotTable
from ckptless.launcher.workers import WorkerGroup
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
