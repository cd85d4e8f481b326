"""Connecting a worker to its agent's store: hedged, so one stuck connect costs a fraction of a second.

Why a module of its own: a replacement connects to the generation's store
inside ``ckptless.init()``, and every survivor waits for it at the formation.
Issue 35 caught that connect taking 5.01 s, silently, in about one of twenty
recoveries at W = 32 on this machine (``bench/scale.py``, the ledger's
``membership_adopted`` ``store_s``) while the same connect takes 1-5 ms
otherwise. torch's client retries a refused or reset connect with an
exponential back-off of its own (0.5 s x 1.5^n, jittered, shared with its
validate/ping retry: ``c10d/Backoff.hpp``, ``socket.cpp`` ``tryConnect``) and
logs those retries only at its trace level, so one unlucky attempt waits
seconds while a fresh attempt would connect at once.

So a connect runs on a thread, and if it has not finished after
:data:`HEDGE_AFTER_S` a second one starts beside it (then a third): the first to
connect is used, the others are dropped when they finish (their connection
closes; the store keeps no state per client). The cost in the common case is
one thread start. A store that is really unreachable is still given up after
the same bound as before (each attempt's ``CONNECT_S``, about twice that with
torch's one retry), with the first attempt's error.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from datetime import timedelta
from typing import Union

import torch.distributed as dist

from ckptless.errors import TransportError

log = logging.getLogger(__name__)

#: The connect timeout of a worker's store client. torch's client retries a refused or unanswered connect
#: until this timeout, backs off and tries once more (measured: ~70 s for a 30 s timeout when the store's
#: agent had died with its node; 28.5 s for 15 s on a closed port), so a store that is not there is given
#: up in about twice this (a failed formation: the leader re-plans with a live store), not in minutes.
CONNECT_S = 8.0
#: How long one attempt may take before another starts beside it (a connect takes 1-5 ms here, 80 ms at
#: worst under load 35 with 32 ranks on two cores: issue 35's bench/scale.py runs).
HEDGE_AFTER_S = 0.5
#: At most this many attempts run for one connect.
MAX_ATTEMPTS = 3

_Outcome = Union[dist.Store, BaseException]


def connect(host: str, port: int, timeout_s: float, hedge_after_s: float = HEDGE_AFTER_S,
            max_attempts: int = MAX_ATTEMPTS) -> dist.Store:
    """A client of the store at ``host:port``, its operations bounded by ``timeout_s`` once connected.

    Raises :class:`TransportError` once every attempt failed (the first one's error)."""
    results: queue.Queue[tuple[int, float, _Outcome]] = queue.Queue()
    started: list[float] = []
    per_attempt = min(timeout_s, CONNECT_S)

    def attempt(i: int) -> None:
        t0 = time.monotonic()
        try:
            out: _Outcome = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=per_attempt),
                                          use_libuv=True)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller (or dropped: a later attempt won)
            out = exc
        results.put((i, time.monotonic() - t0, out))

    def start() -> None:
        started.append(time.monotonic())
        threading.Thread(target=attempt, args=(len(started) - 1,), name=f"ckptless-store-connect-{len(started)}",
                         daemon=True).start()

    start()
    probe: dict[str, str] = {}
    errors: dict[int, BaseException] = {}
    deadline = time.monotonic() + max_attempts * (2 * per_attempt + 5.0)  # torch retries each attempt once
    while True:
        try:
            i, took, out = results.get(timeout=hedge_after_s)
        except queue.Empty:
            if time.monotonic() > deadline:
                raise TransportError(f"cannot reach the agent's store at {host}:{port}: no connect attempt "
                                     f"ended within {deadline - started[0]:.0f}s") from None
            if len(started) < max_attempts:
                if len(started) == 1:
                    _probe(host, port, probe)
                start()
            continue
        if isinstance(out, BaseException):
            errors[i] = out
            if len(errors) == len(started):  # none left running: the store is not there
                first = errors[min(errors)]
                raise TransportError(f"cannot reach the agent's store at {host}:{port}: {first}") from first
            continue
        if i > 0:
            _report_late(results, started, i, took, host, port, 2 * per_attempt + 5.0)
        elapsed = time.monotonic() - started[0]
        if elapsed > 2 * hedge_after_s:
            log.warning("the store at %s:%s took %.2fs to connect (%d attempts; %s)", host, port, elapsed,
                        len(started), ", ".join(f"{k} {v}" for k, v in probe.items()) or "no probe")
        out.set_timeout(timedelta(seconds=timeout_s))
        return out


def _probe(host: str, port: int, into: dict[str, str]) -> None:
    """Where a slow connect waits, for its warning: the name lookup and a bare TCP connect, each timed."""

    def run() -> None:
        t0 = time.monotonic()
        try:
            addrs = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            into["lookup"] = f"{time.monotonic() - t0:.3f}s"
            t1 = time.monotonic()
            with socket.create_connection((str(addrs[0][4][0]), port), timeout=CONNECT_S):
                into["bare connect"] = f"{time.monotonic() - t1:.3f}s"
        except OSError as exc:
            into["probe"] = f"failed after {time.monotonic() - t0:.3f}s: {exc}"

    threading.Thread(target=run, name="ckptless-store-probe", daemon=True).start()


def _report_late(results: queue.Queue[tuple[int, float, _Outcome]], started: list[float], won: int, took: float,
                 host: str, port: int, bound_s: float) -> None:
    """Attempt ``won`` connected first: say so, and how long the first attempt took, once it ends."""
    first_started = started[0]
    log.warning("the store at %s:%s: attempt %d connected in %.3fs, %.2fs after the first attempt began "
                "(still connecting)", host, port, won + 1, took, time.monotonic() - first_started)

    def watch() -> None:
        for _ in range(len(started) - 1):  # every other attempt ends within its own bound
            try:
                i, t, out = results.get(timeout=bound_s)
            except queue.Empty:
                return
            if i == 0:
                what = "connected" if not isinstance(out, BaseException) else f"failed ({out})"
                log.warning("the store at %s:%s: the first connect attempt %s after %.2fs", host, port, what, t)

    threading.Thread(target=watch, name="ckptless-store-connect-late", daemon=True).start()
