"""A CPU backend with NCCL's failure semantics, for the recovery tests (no multi-GPU machine here).

Why: where recovery depends on it, NCCL behaves unlike Gloo, and NCCL refuses
two ranks of one communicator on one GPU, so a multi-rank NCCL failure cannot
run on this workplace's machines at all. What matters, and what this backend
reproduces on CPU (data moved by Gloo underneath):

* when a peer dies, a collective does **not** raise: it stays incomplete
  (NCCL's kernel spins; the CPU thread blocks at its next sync), whatever
  Gloo underneath saw, until the communicator is **aborted** from another
  thread; then it fails;
* it connects **lazily**, as NCCL does without a bound device: at
  ``eager_connect_single_device`` or else inside its first collective (then it
  prints ``[nccl_like] connected lazily``: a formation that forgot to connect
  it, leaving the connect to the user's first step, shows in the worker's log);
* a watchdog acts at the collective timeout as torch's does with
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING``: 1 or 3 (torchrun's default) tears the
  process down (``abort()``, SIGABRT, as NCCL's watchdog), 2 aborts the
  communicator and keeps the process, 0 does nothing.

Registered as the backend ``nccl_like``; a job uses it for its groups' CPU
collectives with ``CKPTLESS_CPU_BACKEND=nccl_like`` and :data:`SITE` first on
its ``PYTHONPATH`` (:func:`job_env`): that directory's ``sitecustomize``
imports this module in every process, so scripts run unchanged. Not product code: it lives under
``tests/`` and only models the failure semantics, not NCCL's performance.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ckptless.worker.rebindable import new_gloo

NAME = "nccl_like"
SITE = Path(__file__).resolve().parent / "nccl_site"


def job_env(mode: str = "2") -> dict[str, str]:
    """The environment a test job needs to run its groups on this backend (``mode``: torch's
    ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, 2 being ckptless-run's default)."""
    repo = SITE.parents[2]
    return {"CKPTLESS_CPU_BACKEND": NAME, "TORCH_NCCL_ASYNC_ERROR_HANDLING": mode,
            "PYTHONPATH": os.pathsep.join([str(SITE), str(repo), os.environ.get("PYTHONPATH", "")])}
log = logging.getLogger(__name__)
_OPS = ("allreduce", "allreduce_coalesced", "broadcast", "barrier", "allgather", "_allgather_base",
        "allgather_into_tensor_coalesced", "reduce_scatter", "_reduce_scatter_base",
        "reduce_scatter_tensor_coalesced", "alltoall_base", "alltoall", "gather", "scatter", "reduce", "send",
        "recv")


class _HeldWork(dist.Work):
    """Completes when Gloo's op succeeds; when it fails, only once the group is aborted.

    After an abort, as with NCCL: ``wait()`` raises, but the future (what the DDP reducer
    waits on, in C++) completes with the op's tensors as they are: NCCL marks it complete at
    enqueue and the failure only shows at the next call. The values are then garbage, as on a
    GPU; ckptless must not protect them (it checks the generation after each step)."""

    def __init__(self, group: NcclLikeGroup, inner: dist.Work, value: Any) -> None:
        super().__init__()
        # Weak: Gloo runs _on_inner on its own worker thread, and the callback is the last holder of
        # this work once ckptless dropped the generation's groups; a strong reference would make that
        # thread drop the last reference to the Gloo group it belongs to, whose destructor joins that
        # very thread ('terminate: Resource deadlock avoided', SIGABRT; seen twice in 2026-11-27 runs).
        self._group = weakref.ref(group)
        self._value = value
        self._error: str | None = None
        self._fut: torch.futures.Future[Any] = torch.futures.Future()
        self.started = time.monotonic()
        group._track(self)
        try:
            fut = inner.get_future()
        except RuntimeError:  # a Gloo work without a future (send/recv): wait for it on a thread
            fut = torch.futures.Future()
            threading.Thread(target=_complete_from_wait, args=(inner, fut), daemon=True).start()
        fut.add_done_callback(self._on_inner)

    def _on_inner(self, f: torch.futures.Future[Any]) -> None:
        try:
            value = f.wait()
        except Exception:  # noqa: BLE001 - a peer failed: NCCL does not say so, the work just never ends
            group = self._group()
            if group is not None:
                group._hold(self)
            return
        group = self._group()
        if group is not None:
            group._untrack(self)
        if not self._fut.done():
            self._fut.set_result(value)

    def fail(self, why: str) -> None:
        self._error = why
        if not self._fut.done():
            self._fut.set_result(self._value)

    def wait(self, timeout: Any = None) -> bool:
        self._fut.wait()
        if self._error is not None:
            raise RuntimeError(f"NCCL communicator was aborted: {self._error}")
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._fut

    def is_completed(self) -> bool:
        return bool(self._fut.done())


def _complete_from_wait(inner: dist.Work, fut: torch.futures.Future[Any]) -> None:
    try:
        inner.wait()
    except Exception as exc:  # noqa: BLE001 - handed to the held work
        fut.set_exception(exc)
        return
    fut.set_result(None)


class NcclLikeGroup(dist.ProcessGroup):
    """One communicator: Gloo moves the bytes, NCCL's rules decide when a failure shows."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: Any, name: str) -> None:
        super().__init__(rank, size)
        self._connect_args = (store, rank, size, timeout)
        self._conn: dist.ProcessGroupGloo | None = None
        self._timeout_s = timeout.total_seconds()
        self._name = name
        self._lock = threading.Lock()
        self._connect_lock = threading.Lock()  # not _lock: an abort must never wait for a connect
        self._live: set[_HeldWork] = set()
        self._aborted: str | None = None
        mode = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        self._mode = int(mode) if mode.strip().isdigit() else 1
        threading.Thread(target=self._watchdog, name=f"nccl-like-watchdog-{name}", daemon=True).start()

    def getBackendName(self) -> str:
        return NAME

    def eager_connect_single_device(self, device: Any) -> None:
        """What ``ProcessGroupNCCL`` does for a bound device: connect now, not in the first collective."""
        self._connect()

    def _connect(self) -> dist.ProcessGroupGloo:
        with self._connect_lock:
            if self._conn is None:
                self._conn = new_gloo(*self._connect_args)
            return self._conn

    @property
    def _gloo(self) -> dist.ProcessGroupGloo:
        if self._conn is None:
            print(f"[nccl_like] connected lazily inside a collective of {self._name!r}", flush=True)
            return self._connect()
        return self._conn

    def abort(self) -> None:
        """ncclCommAbort: every incomplete work fails now, and every later one at once."""
        with self._lock:
            self._aborted = self._aborted or "abort() called"
            works = list(self._live)
            self._live.clear()
        for w in works:
            w.fail(self._aborted)

    def _track(self, w: _HeldWork) -> None:
        with self._lock:
            aborted = self._aborted
            if aborted is None:
                self._live.add(w)
        if aborted is not None:
            w.fail(aborted)

    def _untrack(self, w: _HeldWork) -> None:
        with self._lock:
            self._live.discard(w)

    def _hold(self, w: _HeldWork) -> None:
        with self._lock:
            aborted = self._aborted
        if aborted is not None:
            w.fail(aborted)

    def _watchdog(self) -> None:
        while self._aborted is None:
            time.sleep(0.1)
            now = time.monotonic()
            with self._lock:
                late = [w for w in self._live if now - w.started > self._timeout_s]
            if not late:
                continue
            if self._mode in (1, 3):  # TearDown / SkipCleanUp: as NCCL's watchdog, the process ends
                print(f"[nccl_like] watchdog: a collective of {self._name!r} exceeded {self._timeout_s:.0f}s: "
                      "tearing the process down (TORCH_NCCL_ASYNC_ERROR_HANDLING=%d)" % self._mode, flush=True)
                os.abort()
            if self._mode == 2:  # CleanUpOnly: abort the communicator, keep the process
                print(f"[nccl_like] watchdog: a collective of {self._name!r} exceeded {self._timeout_s:.0f}s: "
                      "aborting the communicator (TORCH_NCCL_ASYNC_ERROR_HANDLING=2)", flush=True)
                self.abort()
                return


def _forward(op: str) -> Any:
    def method(self: NcclLikeGroup, *args: Any) -> dist.Work:
        return _HeldWork(self, getattr(self._gloo, op)(*args), args[0] if args else None)

    method.__name__ = op
    return method


for _op in _OPS:
    setattr(NcclLikeGroup, _op, _forward(_op))


def _create(opts: Any, _backend_opts: Any) -> NcclLikeGroup:
    return NcclLikeGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout, str(opts.group_id))


if NAME.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])
