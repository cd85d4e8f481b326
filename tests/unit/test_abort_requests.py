"""One abort per broken generation per process, however many threads ask (``worker/abort.py``).

Why it matters: every request used to queue an abort of its own, and each abort scans the
process's open descriptors (``sockets.shutdown``); a process whose many threads (a DDP reducer's
callbacks, the control thread) report the same failure paid one scan each."""

from __future__ import annotations

import threading

import pytest

from ckptless.worker import abort


def test_requests_for_a_queued_generation_are_one_abort(monkeypatch: pytest.MonkeyPatch) -> None:
    gate, entered, marker = threading.Event(), threading.Event(), threading.Event()
    calls: list[int] = []

    def slow_abort(generation: int, why: str) -> int:
        calls.append(generation)
        entered.set()
        if generation == 9003:
            marker.set()
        gate.wait(10)
        return 0

    monkeypatch.setattr(abort, "abort_now", slow_abort)
    monkeypatch.setattr(abort, "_aborted", set())
    monkeypatch.setattr(abort, "_queued", set())
    abort.request(9001, "first")
    assert entered.wait(10), "the aborter thread never served the first request"
    for _ in range(20):  # while the first is being served
        abort.request(9001, "again")
    abort.request(9002, "another generation")
    abort.request(9002, "another generation, again")
    gate.set()
    abort.request(9003, "marker")  # served after the others (one queue, one thread)
    assert marker.wait(10), "the aborter thread stopped serving"
    assert calls == [9001, 9002, 9003], calls
