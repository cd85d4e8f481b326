"""The agent's hang watchdog: the facts for killing a local worker whose heartbeat stalled, or whose teardown
outlives its program's end (the node machine decides: launcher/node_machine.py).

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

import os
import threading
import time
from collections.abc import Callable, Mapping

from ckptless.launcher.node_machine import Heartbeat, HeartbeatsRead, TeardownsStuck, startup_grace_s
from ckptless.launcher.slots import SlotTable
from ckptless.launcher.workers import WorkerGroup
from ckptless.worker import exit_file
from ckptless.worker import read_progress

__all__ = ["end_stuck_teardowns", "starting", "startup_grace_s", "stuck_in_teardown", "watch_hangs"]


def starting(heartbeat_file: str) -> bool:
    """Has the worker behind this heartbeat not trained a step yet?"""
    doc = read_progress(heartbeat_file)
    return doc is not None and doc.get("state") == "starting"


def watch_hangs(timeout: float | None, slots: SlotTable, feed: Callable[[HeartbeatsRead], object],
                stopping: threading.Event) -> None:
    """Until ``stopping``: read each live rank's heartbeat age (and, past ``timeout``, whether it has trained a
    step yet) and hand them to the node machine, which decides which are frozen and kills them
    (launcher/node_rules.py, frozen)."""
    if not timeout:
        return
    while not stopping.wait(min(timeout / 4, 0.25)):
        now = time.time()
        beats = []
        for slot in slots.all():
            if not slot.alive or slot.rank is None:
                continue
            try:
                age = now - os.stat(slot.heartbeat_file).st_mtime
            except FileNotFoundError:
                continue  # not started yet (a respawn's predecessor's file is removed)
            beats.append(Heartbeat(slot.local_rank, slot.rank, slot.worker_id, slot.heartbeat_file, age,
                                   starting(slot.heartbeat_file) if age > timeout else None))
        if beats:
            feed(HeartbeatsRead(tuple(beats)))


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
                        feed: Callable[[TeardownsStuck], object]) -> None:
    """Hand the workers stuck in their teardown (see the module doc) to the node machine, which kills each
    once, with one line; the driver keeps their pids for the exit recorder, which records the code each
    declared instead of the signal."""
    stuck = stuck_in_teardown(group.pids(), exit_path, grace_s, time.time())
    if stuck:
        feed(TeardownsStuck(tuple(stuck)))
