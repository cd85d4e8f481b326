"""Processes seen from outside, through ``/proc``: state, parent, and a node's whole process tree.

Why ``/proc`` and not the handles we hold: the chaos runner must see processes it did not start
(an agent's workers, a spare forked by a fork server, the orphans of a killed agent) and must not
mistake a zombie for a live rank. Why its own module: it knows nothing of a cluster or a fault;
the cluster (which processes belong to a job) and the injector (what a node loss kills) both
ask it the same questions.
"""

from __future__ import annotations

import os


def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    return text[text.rindex(")") + 2:].split()  # the command name may contain spaces and parens


def parent_pid(pid: int) -> int:
    """The parent of ``pid``; -1 when ``pid`` is gone."""
    try:
        return int(_stat_fields(pid)[1])
    except OSError:
        return -1


def proc_state(pid: int) -> str:
    """The one-letter state of ``pid`` (R, S, T, Z, ...); OSError when it is gone."""
    return _stat_fields(pid)[0]


def alive(pid: int) -> bool:
    """Running, sleeping or stopped: not gone and not a zombie (a SIGSTOPped worker is alive)."""
    try:
        return proc_state(pid) not in ("Z", "X")
    except OSError:
        return False


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first), from ``/proc``: a node's whole process tree."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                children.setdefault(parent_pid(int(entry)), []).append(int(entry))
            except OSError:
                continue
    found: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        found.append(p)
        todo.extend(children.get(p, []))
    return found
