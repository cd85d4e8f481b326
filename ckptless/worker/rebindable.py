# mypy: disable-error-code="override, assignment, call-arg, attr-defined"
# (this module overrides pybind methods of torch's ProcessGroup with the signatures C++ calls; torch's
# stubs name some of them differently and lack the private helpers used here)
"""Process groups that survive a recovery: the object never changes, its communicator does.

Why: user code holds groups (``dist.group.WORLD``, ``dist.new_group``'s, a DDP module's, an FSDP2
``DeviceMesh``'s); after a failure they must work again, same ranks, nothing re-wrapped. Measured on
torch 2.13: ``ProcessGroup._register_backend`` on a group that already has a Gloo backend keeps the
old one, and the C++ ``Backend`` cannot be subclassed from Python; a Python subclass of
``dist.ProcessGroup`` can, and C++ callers (the DDP reducer, FSDP2's collectives, ``DeviceMesh``)
reach its overrides through the pybind trampoline. So every group of a ckptless job is a
:class:`RebindableGroup`, made by a registered c10d backend plugin
(``init_process_group("ckptless")`` and every ``new_group`` after it), and each
generation *binds* it to a fresh inner ``ProcessGroup`` + Gloo backend built on
``PrefixStore(f"ckptless/gen{g}/pg/{name}/")``: survivors and replacements
build a generation's communicators with the same code, from keys no earlier
generation used (torchrun's shared-store breakage cannot happen).

An *unbound* group answers collectives locally ("echo": all_reduce leaves the input, all_gather
replicates it). A replacement runs the user's setup code (``new_group``, the DDP constructor's
parameter broadcast, ``fully_shard``) on unbound groups: no collective the survivors are not in ever
leaves the process; its state is then restored from its peers, overwriting what echo computed.

Failures are typed where they arise: a failed ``wait`` raises :class:`ckptless.errors.CollectiveError`
(:class:`~ckptless.errors.CollectiveTimeout` after waiting out the timeout), and every failure (also
those the DDP reducer sees through futures in C++) marks the group broken for that generation.

CUDA tensors (:mod:`ckptless.worker.device`): with NCCL, ``build`` also connects a ProcessGroupNCCL on
the rank's GPU, eagerly and checked, inside the abortable formation (:mod:`ckptless.worker.nccl`;
:func:`ckptless.worker.forming.abort` reaches it before it is installed); with
``CKPTLESS_CUDA_BACKEND=gloo`` the same Gloo backend takes CUDA tensors.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch._C._distributed_c10d as _c10d
from torch._C._distributed_c10d import _create_work_from_future

from ckptless import environment
from ckptless.errors import CollectiveError, CollectiveTimeout, ConfigError
from ckptless.worker import device, forming, gloo_peers, nccl

GLOO = dist.ProcessGroup.BackendType.GLOO
PLUGIN = "ckptless"

log = logging.getLogger(__name__)
_broken_listeners: list[Callable[[int], None]] = []


def on_broken(listener: Callable[[int], None]) -> None:
    """Call ``listener(generation)`` whenever a group first sees a collective of ``generation`` fail
    (from whatever thread saw it: the caller's ``wait()``, a backend's done-callback)."""
    if listener not in _broken_listeners:
        _broken_listeners.append(listener)


TIMED_OUT = 0.9  # a failure after this share of the group's timeout was a timeout, not an abort
_LAZY_ENV = "TORCH_GLOO_LAZY_INIT"
_lazy_lock = threading.Lock()


def new_gloo(store: dist.Store, rank: int, size: int, timeout: timedelta, lazy: bool = False) -> dist.ProcessGroupGloo:
    """A Gloo communicator that binds to this node's ``--local-addr`` when one was given.

    Why: Gloo otherwise binds the address the hostname resolves to (127.0.0.1 on
    many hosts), which peers on other nodes cannot reach ("connectFullMesh ...
    Connection refused"); ``GLOO_SOCKET_IFNAME`` still wins when set (a device per
    interface, as torch's own constructor makes them).

    ``lazy``: connect no pair now; each pair connects on its first message. Every
    group ckptless builds is lazy (the user's: :func:`new_user_gloo`; the mirror
    group: ``groups.mirror_group``), over a
    :class:`~ckptless.worker.gloo_peers.PeerRecordingStore`, so a connection
    that opens after the formation is still ended with its generation. The
    devices are made lazy themselves (``create_device(lazy_init=True)``), never
    through ``TORCH_GLOO_LAZY_INIT`` in the process environment: setting it
    around the constructor raced other threads reading the environment (the
    mirror group forms beside a replacement's setup), a ``setenv`` against a
    ``getenv`` that can crash the process. A torch whose devices take no such
    argument gets the environment variable, under a lock.
    """
    env = environment.current()
    try:
        devices = _gloo_devices(env.gloo_socket_ifname, env.local_addr, lazy)
    except TypeError:  # an older torch: no lazy_init argument (issue 37's inventory: docs/compatibility.md)
        with _lazy_lock, environment.library_setting(_LAZY_ENV, "1" if lazy else "0"):
            devices = _gloo_devices(env.gloo_socket_ifname, env.local_addr, None)
            return _gloo(store, rank, size, timeout, devices)
    return _gloo(store, rank, size, timeout, devices)


def _gloo_devices(ifname: str | None, addr: str | None, lazy: bool | None) -> list[Any]:
    kw = {} if lazy is None else {"lazy_init": lazy}
    if ifname:
        return [dist.ProcessGroupGloo.create_device(interface=i.strip(), **kw) for i in ifname.split(",") if i.strip()]
    if addr:
        return [dist.ProcessGroupGloo.create_device(hostname=addr, **kw)]
    return [dist.ProcessGroupGloo.create_default_device(**kw)]


def _gloo(store: dist.Store, rank: int, size: int, timeout: timedelta, devices: list[Any]) -> dist.ProcessGroupGloo:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = devices
    opts._threads = 2 * len(devices)  # as torch's own constructor sets it
    return dist.ProcessGroupGloo(store, rank, size, opts)


def new_user_gloo(store: dist.Store, generation: int, rank: int, size: int,
                  timeout: timedelta) -> dist.ProcessGroupGloo:
    """A user group's Gloo communicator for ``generation``: lazy, its peers recorded, and the pairs of
    the usual collectives connected now (collective: every member calls it).

    Why lazy: the eager full mesh is W - 1 sockets and store lookups per rank (W^2
    per generation, every recovery) where a data-parallel step uses a ring and a
    binomial broadcast. Why connect some pairs now: in the formation a dead peer
    aborts it at its deadline; in the user's step it would cost Gloo's connect
    timeout (pytorch/gloo#520: up to 5 x). Which pairs, and how (one message each
    way, all at once): :func:`ckptless.worker.gloo_peers.connect_collective_peers`.
    A pair outside those (all_to_all, another root, send/recv) connects on first
    use, found by address and ended with its generation; a peer that died before
    that first message costs that collective Gloo's connect timeout
    (docs/failure-model.md)."""
    recording = gloo_peers.PeerRecordingStore(store, generation, expect=gloo_peers.collective_peers(rank, size))
    pg = new_gloo(recording, rank, size, timeout, lazy=True)
    nccl.start_sequence_numbers(pg)
    gloo_peers.connect_collective_peers(pg, rank, size)
    return pg


def _keep_work(opts: Any) -> Any:
    """Ask the inner backend for a Work even for a synchronous call (``opts.asyncOp = True``).

    Why: for ``async_op=False`` torch passes ``asyncOp=False`` down, and ProcessGroupNCCL then makes the
    caller's stream wait inside the call and returns no Work at all (``None``; torch's Python accepts
    that: ``distributed_c10d.all_reduce``, "backends that don't sync at CPP level"). Measured on torch
    2.11 + NCCL 2.28.9 (docs/gpu-runs/2026-11-28-h200/session2/): every plain ``dist.all_reduce(t)`` on a
    group of ours failed with "'NoneType' object has no attribute 'wait'". With a Work, torch's Python
    calls :meth:`_TypedWork.wait` right after, which makes the stream wait as before and raises a typed
    error when torch's watchdog already saw the communicator fail. Options without the field (older
    torch, Gloo's send/recv) are left alone."""
    if opts is not None and getattr(opts, "asyncOp", True) is False:
        opts.asyncOp = True
    return opts


def _done_work(result: Any) -> dist.Work:
    fut: torch.futures.Future[Any] = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


class _TypedWork(dist.Work):
    """``wait`` raises CollectiveError; ``get_future`` (the DDP reducer's path, in C++) passes the
    inner future through and records a failure on the group from a done-callback."""

    def __init__(self, group: RebindableGroup, work: dist.Work, gen: int) -> None:
        super().__init__()
        self._g, self._w, self._gen, self._t0 = group, work, gen, time.monotonic()

    def wait(self, timeout: timedelta | None = None) -> bool:
        try:
            return bool(self._w.wait() if timeout is None else self._w.wait(timeout))
        except Exception as exc:
            kind = CollectiveTimeout if self._g.mark_broken(self._gen, time.monotonic() - self._t0) else CollectiveError
            raise kind(f"collective on group {self._g.group_name!r} (generation {self._gen}) failed: "
                       f"{str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__}") from exc

    def get_future(self) -> torch.futures.Future[Any]:
        fut = self._w.get_future()
        g, gen, key, t0 = self._g, self._gen, object(), self._t0
        with g.lock:
            g.pending[key] = fut

        def on_done(f: torch.futures.Future[Any]) -> None:
            try:
                f.wait()
            except Exception:
                g.mark_broken(gen, time.monotonic() - t0)
            with g.lock:
                g.pending.pop(key, None)

        fut.add_done_callback(on_done)
        return fut

    def is_completed(self) -> bool:
        return bool(self._w.is_completed())

    def is_success(self) -> bool:
        return bool(self._w.is_success())

    def exception(self) -> Any:
        return self._w.exception()


class RebindableGroup(dist.ProcessGroup):
    """A registered c10d group whose communicator is replaced per generation (see module doc)."""

    def __init__(self, rank: int, size: int, global_ranks: list[int], timeout: timedelta) -> None:
        super().__init__(rank, size)
        self.global_ranks = list(global_ranks)
        self.timeout = timeout
        self.lock = threading.Lock()
        self.pending: dict[object, torch.futures.Future[Any]] = {}
        self.generation: int | None = None
        self.broken_generation: int | None = None
        self.timed_out_generation: int | None = None  # a collective of it waited out the timeout
        self._name = ""
        self._desc = "undefined"
        self._inner: dist.ProcessGroup | None = None
        self._backends: list[Any] = []
        self._local_only = 0  # > 0: answer locally even when bound (see groups.local_only)
        self._retired: str | None = None  # why this group may no longer be used (see retire)

    # --- identity (a backend-less Python group keeps its own name) ----------------------------
    def getBackendName(self) -> str:
        return PLUGIN

    def _set_group_name(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        return self._name

    @property
    def group_name(self) -> str:
        return self._name

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    @property
    def group_desc(self) -> str:
        return self._desc

    # --- binding --------------------------------------------------------------------------------
    @property
    def bound(self) -> bool:
        return self._inner is not None

    def mark_broken(self, generation: int, waited_s: float = 0.0) -> bool:
        """A collective of ``generation`` failed after ``waited_s``; True if it waited out the timeout
        (an abort ends one at once): the generation then counts as timed out (``timed_out_generation``)."""
        if waited_s >= TIMED_OUT * self.timeout.total_seconds():
            self.timed_out_generation = generation
        newly = self.broken_generation is None or generation > self.broken_generation
        if newly:
            self.broken_generation = generation
            for listener in list(_broken_listeners):
                listener(generation)
        return self.timed_out_generation == generation

    def abort(self, generation: int) -> int:
        """Abort the backends of ``generation`` that need an explicit abort to end a blocked
        collective (NCCL: ``ncclCommAbort``; not Gloo, whose connections ``sockets.shutdown`` ends);
        returns how many aborts it started (each on a thread of its own: :func:`ckptless.worker.forming.abort_async`). Called
        from a thread other than the one blocked (worker/abort.py); the communicators stay referenced
        until :meth:`release`."""
        with self.lock:
            if self.generation != generation:
                return 0
            if self.broken_generation is None or generation > self.broken_generation:
                self.broken_generation = generation
            backends = [b for b in self._backends if not isinstance(b, dist.ProcessGroupGloo)]
        return sum(forming.abort_async(b, generation) for b in backends)

    def backend_error(self, generation: int) -> str | None:
        """What torch's own machinery saw go wrong with a backend of ``generation`` (``Backend.get_error``:
        TIMEOUT, COMM_ERROR, REMOTE_ERROR), or None. Gloo does not track it (raises: skipped). O(backends)."""
        with self.lock:
            if self.generation != generation:
                return None
            backends = [b for b in self._backends if not isinstance(b, dist.ProcessGroupGloo)]
        success = getattr(_c10d, "ErrorType", None)
        for b in backends:
            try:
                error = b.get_error()
            except (AttributeError, RuntimeError):  # no such API (an older torch), or a backend without it
                continue
            if success is not None and error != success.SUCCESS:
                self.mark_broken(generation)
                return str(error)
        return None

    def build(self, store: dist.Store, generation: int,
              physical: tuple[int, int] | None = None) -> tuple[dist.ProcessGroup, list[Any]]:
        """The generation's communicator (blocks until every member of the group built it). ``physical``:
        this process's (index, count) among the survivors of a generation with fewer ranks (worker/hosted.py):
        the communicator spans them, the group keeps its logical rank and size (DDP's reducer divides by it)."""
        rank, size = physical if physical is not None else (self.rank(), self.size())
        prefix = dist.PrefixStore(f"ckptless/gen{generation}/pg/{self._name}/", store)
        what = f"group {self._name!r} (generation {generation})"
        cpu_backend = environment.current().cpu_backend
        if cpu_backend != "gloo":
            group = self._build_plugin(cpu_backend, prefix, rank, size)
            forming.add(generation, group)
            nccl.connect(group, torch.device("cpu"))  # a lazy backend connects here, not in the first step
            nccl.check_members(group, torch.device("cpu"), size, what, self.timeout.total_seconds())
            return group, [group]
        inner = dist.ProcessGroup(prefix, rank, size)
        gloo = new_user_gloo(prefix, generation, rank, size, self.timeout)
        gloo.options.group_name = self._name
        gloo.options.global_ranks_in_group = self.global_ranks
        inner._set_default_backend(GLOO)
        inner._register_backend(torch.device("cpu"), GLOO, gloo)
        backends: list[Any] = [gloo]
        gpu, mode = device.bound(), device.bound_backend()
        if gpu is not None and mode == "nccl":  # not run on several GPUs (docs/architecture.md, "GPU path")
            backend = nccl.build(prefix, rank, size, self.timeout, self._name, self.global_ranks,
                                 gpu, on_created=lambda b: forming.add(generation, b))
            nccl.check_members(backend, gpu, size, what, self.timeout.total_seconds())
            inner._register_backend(torch.device("cuda"), nccl.NCCL, backend)
            backends.append(backend)
        elif gpu is not None and mode == "gloo":  # ranks share a GPU (tests on one GPU): Gloo copies via the host
            inner._register_backend(torch.device("cuda"), GLOO, gloo)
        return inner, backends

    def _build_plugin(self, name: str, store: dist.Store, rank: int, size: int) -> Any:
        """The CPU communicator from a backend registered under ``name`` (``CKPTLESS_CPU_BACKEND``):
        its creator must return a group. Used by the tests' NCCL-semantics backend
        (``tests/harness/nccl_like.py``), which CI runs the recovery tests on."""
        plugin = dist.Backend._plugins.get(name.upper())
        if plugin is None:
            raise ConfigError("CKPTLESS_CPU_BACKEND", name, "no such backend was registered (dist.Backend."
                                                            "register_backend) in this process before ckptless.init()")
        opts = dist.distributed_c10d._DistributedBackendOptions()
        opts.store, opts.group_rank, opts.group_size = store, rank, size
        opts.timeout, opts.group_id, opts.global_ranks_in_group = self.timeout, self._name, self.global_ranks
        return plugin.creator_fn(opts, None)

    def install(self, generation: int, inner: dist.ProcessGroup, backends: list[Any]) -> list[Any]:
        """Bind ``generation``'s communicator; returns what was bound before (normally nothing: the
        previous generation was released), for the caller to hand to the reaper."""
        with self.lock:
            old = [x for x in (self._inner, *self._backends) if x is not None]
            self._inner, self._backends, self.generation = inner, backends, generation
            self.broken_generation = None
        return old

    def release(self) -> list[Any]:
        """Unbind this generation's communicator; returns the references this group held (the inner
        group, its backends, pending futures) for the caller to drop *off the training thread*
        (:mod:`ckptless.worker.reaper`): the backend's destructor joins its worker threads, which can
        sit on a dead peer until the collective timeout (Gloo) or behind torch's watchdog (NCCL).

        The references leave the lock with the caller: one of the backend's threads may be running a
        done-callback that takes this lock (a deadlock seen here in 3 of 5 runs before this was so).
        Gloo's abort()/shutdown() do not close its sockets (measured); ``sockets.shutdown`` ends its
        connections before this is called, so peers are released whether or not the destructor returns."""
        with self.lock:
            old: list[Any] = [x for x in (self._inner, *self._backends) if x is not None]
            old.extend(self.pending.values())
            self._inner, self._backends, self.generation = None, [], None
            self.pending.clear()
        return old

    def set_local_only(self, on: bool) -> None:
        self._local_only += 1 if on else -1

    def retire(self, why: str) -> None:
        """This group object is replaced (a pre-built spare's default group, re-made under the rank it
        took): every later collective on it raises instead of answering locally, which would be a
        silently wrong result for code that kept a reference from the setup."""
        self._retired = why

    def answers_locally(self) -> bool:
        """True while every collective on this group stays in this process (unbound or local-only): the
        protocol ``ckptless.state.AnswersLocally`` (held to it in worker/groups.py), asked by state that
        replays collectives on restore."""
        return self._live is None

    @property
    def _live(self) -> dist.ProcessGroup | None:
        """The communicator collectives go to (None: answer locally)."""
        if self._retired is not None:
            raise ConfigError("process group", self._name, self._retired)
        return None if self._local_only else self._inner

    def _wrap(self, work: dist.Work | None) -> dist.Work:
        assert self.generation is not None
        if work is None:  # a backend that synchronised inside the call (see _keep_work): nothing to wait on
            return _done_work(None)
        return _TypedWork(self, work, self.generation)

    def _need(self) -> dist.ProcessGroup:
        inner = self._live
        if inner is None:
            raise CollectiveError(f"group {self._name!r} is not bound to a generation (this operation has no "
                                  "local answer; it can only run once the rank joined its peers)")
        return inner

    # --- collectives: unbound -> a local answer (used while a replacement runs setup code) -------
    def allreduce(self, tensors: Any, opts: Any = None) -> dist.Work:
        if self._live is None:
            return _done_work(tensors)
        return self._wrap(self._live.allreduce(tensors) if opts is None else self._live.allreduce(tensors, _keep_work(opts)))

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> dist.Work:
        if self._live is None:
            return _done_work(tensors)
        return self._wrap(self._live.allreduce_coalesced(tensors, _keep_work(opts)))

    def broadcast(self, tensors: Any, opts: Any = None) -> dist.Work:
        if self._live is None:
            return _done_work(tensors)
        return self._wrap(self._live.broadcast(tensors, _keep_work(opts)))

    def barrier(self, opts: Any = None) -> dist.Work:
        if self._live is None:
            return _done_work([])
        return self._wrap(self._live.barrier() if opts is None else self._live.barrier(_keep_work(opts)))

    def allgather(self, outs: Any, ins: Any, opts: Any = None) -> dist.Work:
        if self._live is None:
            for o_list, i in zip(outs, ins):
                for o in o_list:
                    o.copy_(i)
            return _done_work(outs)
        return self._wrap(self._live.allgather(outs, ins, _keep_work(opts)))

    def _allgather_base(self, out: Any, inp: Any, opts: Any = None) -> dist.Work:
        if self._live is None:
            out.view(self.size(), -1).copy_(inp.reshape(1, -1).expand(self.size(), -1))
            return _done_work([out])
        return self._wrap(self._live._allgather_base(out, inp, _keep_work(opts)))

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(self, outs: Any, ins: Any, opts: Any = None) -> dist.Work:
        if self._live is None:
            for o, i in zip(outs, ins):
                o.view(self.size(), -1).copy_(i.reshape(1, -1).expand(self.size(), -1))
            return _done_work(outs)
        return self._wrap(self._live.allgather_into_tensor_coalesced(outs, ins, _keep_work(opts)))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(self, outs: Any, ins: Any, opts: Any = None) -> dist.Work:
        if self._live is None:
            return _done_work(outs)
        return self._wrap(self._live.reduce_scatter(outs, ins, _keep_work(opts)))

    def _reduce_scatter_base(self, out: Any, inp: Any, opts: Any = None) -> dist.Work:
        if self._live is None:
            return _done_work([out])
        return self._wrap(self._live._reduce_scatter_base(out, inp, _keep_work(opts)))

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outs: Any, ins: Any, opts: Any = None) -> dist.Work:
        if self._live is None:
            return _done_work(outs)
        return self._wrap(self._live.reduce_scatter_tensor_coalesced(outs, ins, _keep_work(opts)))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def alltoall_base(self, out: Any, inp: Any, osplit: Any, isplit: Any, opts: Any = None) -> dist.Work:
        return self._wrap(self._need().alltoall_base(out, inp, osplit, isplit, _keep_work(opts)))

    all_to_all_single = alltoall_base

    def alltoall(self, outs: Any, ins: Any, opts: Any = None) -> dist.Work:
        return self._wrap(self._need().alltoall(outs, ins, _keep_work(opts)))

    def gather(self, outs: Any, ins: Any, opts: Any = None) -> dist.Work:
        return self._wrap(self._need().gather(outs, ins, _keep_work(opts)))

    def scatter(self, outs: Any, ins: Any, opts: Any = None) -> dist.Work:
        return self._wrap(self._need().scatter(outs, ins, _keep_work(opts)))

    def reduce(self, tensors: Any, opts: Any = None) -> dist.Work:
        return self._wrap(self._need().reduce(tensors, _keep_work(opts)))

    def send(self, tensors: Any, dst: int, tag: int = 0) -> dist.Work:
        return self._wrap(self._need().send(tensors, dst, tag))

    def recv(self, tensors: Any, src: int, tag: int = 0) -> dist.Work:
        return self._wrap(self._need().recv(tensors, src, tag))

    def recv_anysource(self, tensors: Any, tag: int = 0) -> dist.Work:
        return self._wrap(self._need().recv_anysource(tensors, tag))
