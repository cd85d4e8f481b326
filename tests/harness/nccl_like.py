"""A CPU backend with NCCL's (and torch's ProcessGroupNCCL's) failure semantics, for the recovery tests.

Why: where recovery depends on it, NCCL behaves unlike Gloo, and CI has no GPU. Gloo moves the
bytes; what this models is when and how a failure shows, and what torch's own machinery around
NCCL does to the processes. Each rule names the torch source it models (``ProcessGroupNCCL.cpp``
as of torch 2.13, "S2" lines, from the reading in docs/gpu-runs/2026-11-28-h200/README.md) and,
where it was measured on real NCCL, the measurement (one H200, torch 2.11, NCCL 2.28.9, three
ranks over NCCL's socket transport: docs/gpu-runs/2026-11-28-h200/nccl_facts.json):

1. **A peer's death.** A collective with a dead peer neither completes nor raises. Over the
   socket transport (the default here, ``NCCL_LIKE_TRANSPORT=socket``) NCCL reports the error to
   torch's watchdog after a while (measured: 5.2 s; ``NCCL_LIKE_REPORT_S``, default 5); over
   P2P/SHM (``NCCL_LIKE_TRANSPORT=p2p``) never, only the collective timeout shows it. The watchdog
   polls every 100 ms (S2:2281-2286, 2352-2381).
2. **The dump key.** When the watchdog sees a work fail (the error above, or the timeout), it
   writes ``exception_dump`` into the *root* store, beneath every PrefixStore (the agent's
   TCPStore, shared by every generation), whatever the error mode, and raises the process-wide
   dump flag (S2:2393-2420, 2727-2736, 986-992). Measured: the key appeared 5.2 s after the death.
3. **The watchdog's post-error sleep.** Then it sleeps 4 x ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC``
   (60 s by default) holding the group's work list (a new collective's enqueue waits), and then
   acts by ``TORCH_NCCL_ASYNC_ERROR_HANDLING``: 1 or 3 (unset is 3) end the process (SIGABRT),
   2 aborts the communicator, 0 does nothing (S2:2278, 2426-2437, 2180-2215).
4. **The heartbeat monitor.** Only the process's first group (a per-process counter, never reset)
   polls the root key every ``TORCH_NCCL_COORD_CHECK_MILSEC`` (1000), if ``TORCH_NCCL_DUMP_ON_TIMEOUT``
   (default on), and the dump flag; seeing either, it dumps, sleeps ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``
   (480) and ends the process, if ``TORCH_NCCL_ENABLE_MONITORING`` (default on) and it was not
   stopped (``abort()`` stops it; its sleep ends within 1 s of that, as in 2.13) (S2:944, 962,
   1839-2123). Measured: a process whose first group formed after the key existed was ended 14 s
   later (heartbeat timeout 8 s); with monitoring or dumping off it lived.
5. **Formation.** ``eager_connect_single_device`` exchanges the unique id (rank 0 ``set``s it, the
   others block in ``get`` on the caller's store client, holding that client's one lock up to the
   client's timeout: measured, another thread's ``add`` on the client waited 10.0 s) and starts
   the init; the first collective waits for the init holding the communicator's lock up to
   ``TORCH_NCCL_NONBLOCKING_TIMEOUT``, and ``abort()`` takes that lock first (measured: an abort
   3 s into such a wait returned after 10.0 s of a 12 s timeout) (NCCLUtils.cpp S2:140-214,
   370-371; S2:2875-2954; TCPStore.cpp S2:472-491, 561-609). A group never told to connect does
   all of it inside its first collective and prints ``[nccl_like] connected lazily``.
6. **After an abort.** ``wait()`` returns True and raises nothing (the work's values are garbage,
   as on a GPU); the next collective raises "NCCL communicator was aborted" (S2:644-649, 857-926;
   NCCLUtils.cpp S2:142-154). What the watchdog saw stays readable: ``get_error()`` answers
   TIMEOUT or COMM_ERROR from then on (``ProcessGroupNCCL::getError``, ``error_``).
7. **A synchronous collective has no Work.** Called with ``opts.asyncOp`` False (torch's Python passes
   ``async_op=False`` down), ProcessGroupNCCL synchronises inside the call (on a GPU: the caller's
   stream waits for NCCL's) and returns ``None``; torch's Python accepts that ("backends that don't
   sync at CPP level", ``distributed_c10d.all_reduce``). Measured on torch 2.11 + NCCL 2.28.9: a plain
   ``dist.all_reduce(t)`` through a group of ours got ``None`` (docs/gpu-runs/2026-11-28-h200/session2/).

Registered as the backend ``nccl_like``; a job uses it for its groups' CPU collectives with
``CKPTLESS_CPU_BACKEND=nccl_like`` and :data:`SITE` first on its ``PYTHONPATH`` (:func:`job_env`):
that directory's ``sitecustomize`` imports this module in every process, so scripts run unchanged.
Not product code: it lives under ``tests/`` and models failure semantics, not NCCL's performance.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import torch
import torch._C._distributed_c10d as _c10d
import torch.distributed as dist

from ckptless.worker.rebindable import new_gloo

NAME = "nccl_like"
SITE = Path(__file__).resolve().parent / "nccl_site"
DUMP_KEY = "exception_dump"  # torch's kStoreDumpKey (ProcessGroupNCCL.hpp)


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
_uids = itertools.count()  # torch numbers a process's groups; only uid 0 runs the key-polling monitor
_should_dump = threading.Event()  # torch's process-wide shouldDump_, raised by any group's watchdog


def _env(name: str, default: str) -> str:
    return (os.environ.get(name) or "").strip() or default


def _root(store: dist.Store) -> dist.Store:
    """The store beneath every PrefixStore (torch's getUnderlyingNonPrefixStore)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def _say(text: str) -> None:
    print(f"[nccl_like] {text}", flush=True)


class _HeldWork(dist.Work):
    """Completes when Gloo's op succeeds; when it fails, only once the group is aborted (rule 1), and
    then ``wait()`` returns True with the tensors as they are (rule 6): the failure shows at the next
    collective, and ckptless must notice it by its own generation check, not by this work."""

    def __init__(self, group: NcclLikeGroup, inner: dist.Work | None, value: Any) -> None:
        super().__init__()
        # Weak: Gloo runs _on_inner on its own worker thread, and the callback is the last holder of
        # this work once ckptless dropped the generation's groups; a strong reference would make that
        # thread drop the last reference to the Gloo group it belongs to, whose destructor joins that
        # very thread ('terminate: Resource deadlock avoided', SIGABRT; seen twice in 2026-11-27 runs).
        self._group = weakref.ref(group)
        self._value = value
        self._fut: torch.futures.Future[Any] = torch.futures.Future()
        self.started = time.monotonic()
        self.failed_at: float | None = None
        group._track(self)
        if inner is None:  # Gloo refused the op at once (a broken pair): a failure like any other
            self._failed()
            return
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
            self._failed()
            return
        group = self._group()
        if group is not None:
            group._untrack(self)
        if not self._fut.done():
            self._fut.set_result(value)

    def _failed(self) -> None:
        self.failed_at = time.monotonic()
        group = self._group()
        if group is not None:
            group._hold(self)
            group._poll.set()  # the watchdog looks now (it polls every 100 ms anyway)

    def release(self) -> None:
        """The communicator was aborted: the work ends (its values garbage), without an error."""
        if not self._fut.done():
            self._fut.set_result(self._value)

    def wait(self, timeout: Any = None) -> bool:
        self._fut.wait()
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
    """One communicator: Gloo moves the bytes, NCCL's and torch's rules decide when a failure shows."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: Any, name: str) -> None:
        super().__init__(rank, size)
        self.uid = next(_uids)
        self._store, self._root = store, _root(store)
        self._connect_args = (store, rank, size, timeout)
        self._conn: dist.ProcessGroupGloo | None = None
        self._timeout_s = timeout.total_seconds()
        self._name = name
        self._lock = threading.Lock()  # the live works
        self._comm_lock = threading.RLock()  # NCCLComm's mutex: waitReady holds it, abort takes it (rule 5)
        self._enqueue_lock = threading.Lock()  # the work list the watchdog holds while it sleeps (rule 3)
        self._init_started = False
        self._init_done = threading.Event()
        self._init_error: BaseException | None = None
        self._live: set[_HeldWork] = set()
        self._aborted: str | None = None
        self._error = "SUCCESS"  # what torch's getError() answers (set by the watchdog, rule 6)
        self._stopped = threading.Event()
        self._poll = threading.Event()
        mode = _env("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        self._mode = int(mode) if mode.isdigit() else 3
        threading.Thread(target=self._watchdog, name=f"nccl-like-watchdog-{name}", daemon=True).start()
        if self.uid == 0 and _env("TORCH_NCCL_ENABLE_MONITORING", "1") != "0":
            threading.Thread(target=_monitor, args=(weakref.ref(self), self._root, self._stopped, name),
                             name="nccl-like-monitor", daemon=True).start()

    def getBackendName(self) -> str:
        return NAME

    def get_error(self) -> Any:
        """torch's ``Backend.get_error``: what this communicator's watchdog saw (rule 6)."""
        return getattr(_c10d.ErrorType, self._error)

    # --- formation (rule 5) ------------------------------------------------------------------------
    def eager_connect_single_device(self, device: Any) -> None:
        """What ``ProcessGroupNCCL`` does for a bound device: the unique-id exchange, then the init starts."""
        self._start_init()

    def _start_init(self) -> None:
        if self._init_started:
            return
        self._init_started = True
        key = "nccl_like_uid/0"
        if self.rank() == 0:
            self._store.set(key, "uid")
        else:
            self._store.get(key)  # blocks on the caller's client, holding its one lock (rule 5)

        def init() -> None:
            try:
                self._conn = new_gloo(*self._connect_args)
            except BaseException as exc:  # noqa: BLE001 - shown to the thread that waits for the init
                self._init_error = exc
            finally:
                self._init_done.set()

        threading.Thread(target=init, name=f"nccl-like-init-{self._name}", daemon=True).start()

    def _wait_ready(self) -> dist.ProcessGroupGloo:
        """The first collective waits for the init holding the communicator's lock (``waitReady``)."""
        with self._comm_lock:
            if self._conn is not None:
                return self._conn
            if not self._init_started:
                _say(f"connected lazily inside a collective of {self._name!r}")
                self._start_init()
            limit = float(_env("TORCH_NCCL_NONBLOCKING_TIMEOUT", "1800"))
            if not self._init_done.wait(limit):
                raise RuntimeError(f"NCCL timeout in: NCCLUtils.cpp waitReady (nccl_like), {limit:.0f}s, group "
                                   f"{self._name!r}")
            if self._init_error is not None:
                raise RuntimeError(f"NCCL init failed (nccl_like): {self._init_error}")
            assert self._conn is not None
            return self._conn

    # --- failures ----------------------------------------------------------------------------------
    def abort(self) -> None:
        """ncclCommAbort: waits for the communicator's lock (rule 5); every incomplete work ends, and
        every later collective raises (rule 6). Stops this group's monitor (rule 4)."""
        with self._comm_lock:
            with self._lock:
                self._aborted = self._aborted or "abort() called"
                works = list(self._live)
                self._live.clear()
            self._stopped.set()
        for w in works:
            w.release()

    def _track(self, w: _HeldWork) -> None:
        with self._lock:
            aborted = self._aborted
            if aborted is None:
                self._live.add(w)
        if aborted is not None:
            w.release()

    def _untrack(self, w: _HeldWork) -> None:
        with self._lock:
            self._live.discard(w)

    def _hold(self, w: _HeldWork) -> None:
        with self._lock:
            aborted = self._aborted
        if aborted is not None:
            w.release()

    def _seen_failure(self, now: float) -> str | None:
        """What the watchdog sees this poll: a reported error, or a timeout (rule 1)."""
        report_s = None if _env("NCCL_LIKE_TRANSPORT", "socket") == "p2p" else float(_env("NCCL_LIKE_REPORT_S", "5"))
        with self._lock:
            for w in self._live:
                if w.failed_at is not None and report_s is not None and now - w.failed_at >= report_s:
                    return "a peer's connection failed (the socket transport reported it)"
                if now - w.started > self._timeout_s:
                    return f"a collective exceeded {self._timeout_s:.0f}s"
        return None

    def _watchdog(self) -> None:
        while self._aborted is None:
            self._poll.wait(0.1)  # S2:2281-2286: every 100 ms
            self._poll.clear()
            why = self._seen_failure(time.monotonic())
            if why is None:
                continue
            _say(f"watchdog: {why} in {self._name!r}: writing {DUMP_KEY} to the root store")
            self._error = "TIMEOUT" if why.startswith("a collective exceeded") else "REMOTE_ERROR"
            try:
                self._root.set(DUMP_KEY, str(self.rank()))  # rule 2: the root store, whatever the mode
            except Exception:  # noqa: BLE001 - the store may be gone with its agent
                pass
            _should_dump.set()
            wait_s = 4 * float(_env("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "15000")) / 1000
            with self._enqueue_lock:  # rule 3: new collectives on this group wait meanwhile (an abort does not
                time.sleep(wait_s)  # end the sleep: torch sleeps, S2:2426-2427)
            if self._aborted is not None:
                return
            if self._mode in (1, 3):  # TearDown / SkipCleanUp: the process ends
                _say(f"watchdog: tearing the process down (TORCH_NCCL_ASYNC_ERROR_HANDLING={self._mode})")
                os.abort()
            if self._mode == 2:  # CleanUpOnly: abort the communicator, keep the process
                _say("watchdog: aborting the communicator (TORCH_NCCL_ASYNC_ERROR_HANDLING=2)")
                self.abort()
            return


def _monitor(group: weakref.ref[NcclLikeGroup], root: dist.Store, stopped: threading.Event, name: str) -> None:
    """Rule 4: the heartbeat monitor of the process's first group."""
    period_s = float(_env("TORCH_NCCL_COORD_CHECK_MILSEC", "1000")) / 1000
    dumping = _env("TORCH_NCCL_DUMP_ON_TIMEOUT", "1") != "0"
    while not stopped.wait(period_s):
        if group() is None:
            return  # destroyed: stop()
        if not dumping:
            continue
        try:
            seen = _should_dump.is_set() or root.check([DUMP_KEY])
        except Exception:  # noqa: BLE001 - the store may be gone with its agent
            seen = False
        if not seen:
            continue
        heartbeat_s = float(_env("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "480"))
        _say(f"monitor of {name!r}: dump signal seen; dumping, then ending the process in {heartbeat_s:.0f}s")
        end = time.monotonic() + heartbeat_s
        while time.monotonic() < end:
            if stopped.wait(min(1.0, max(0.0, end - time.monotonic()))) or group() is None:
                return
        _say(f"monitor of {name!r}: Terminating the process after attempting to dump debug info")
        os.abort()


def _forward(op: str) -> Any:
    def method(self: NcclLikeGroup, *args: Any) -> dist.Work | None:
        if self._aborted is not None:  # rule 6: the next collective raises
            raise RuntimeError(f"NCCL communicator was aborted on rank {self.rank()} (nccl_like: {self._aborted})")
        conn = self._wait_ready()
        with self._enqueue_lock:
            try:
                inner: dist.Work | None = getattr(conn, op)(*args)
            except RuntimeError:  # a broken Gloo pair refuses at once; NCCL would enqueue and spin
                inner = None
        work = _HeldWork(self, inner, args[0] if args else None)
        if args and getattr(args[-1], "asyncOp", True) is False:  # rule 7 (on CPU the values must be there)
            work.wait()
            return None
        return work

    method.__name__ = op
    return method


for _op in _OPS:
    setattr(NcclLikeGroup, _op, _forward(_op))


def _create(opts: Any, _backend_opts: Any) -> NcclLikeGroup:
    return NcclLikeGroup(opts.store, opts.group_rank, opts.group_size, opts.timeout, str(opts.group_id))


if NAME.upper() not in dist.Backend._plugins:
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu"])
