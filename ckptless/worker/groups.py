"""This process's groups: created once, bound to one generation's communicators at a time.

Why per generation: after a failure the survivors re-form their groups in the
same process. Every generation's keys live under their own prefix
(``ckptless/gen<G>/``), so no rank ever reads a previous round's rendezvous
keys (torchrun's shared store broke exactly that way here), and the store
lives in the long-lived agent, never in a worker. The user's group objects
(see :mod:`ckptless.worker.rebindable`) never change; binding replaces only
their communicators. The mirroring group is separate, unregistered and per
generation: a background thread drives it, so mirroring never interleaves
with training collectives.

Binding is abortable: every rank first checks in at a store counter (polling
it and an abort condition, e.g. "the coordinator declared this generation
failed"), then builds its Gloo communicators in a helper thread while the
caller keeps polling. A peer that dies during formation therefore costs the
others an abort, not a 30-minute Gloo timeout; a helper thread left inside a
native connect is harmless (it only ever installs into the generation it was
started for) and is covered by the exit guard.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, cast

import torch.distributed as dist

from ckptless import chaos_hooks
from ckptless.errors import ConfigError, TransportError
from ckptless.mirror import agreement
from ckptless.mirror import Deadline
from ckptless.state import AnswersLocally
from ckptless.worker import exit_guard, forming, gloo_peers, reaper, sockets, store_client
from ckptless.worker.rebindable import PLUGIN, RebindableGroup, new_gloo

log = logging.getLogger(__name__)

Abort = Callable[[], "str | None"]  # returns why to give up, or None to keep waiting

_registry: dict[str, RebindableGroup] = {}  # group name -> group, in creation order (same on every rank)
_live: dict[str, Any] = {"store": None, "generation": None}
_lock = threading.Lock()
_early_mirror: dict[int, Any] = {}  # generation -> its mirror group, formed ahead (form_mirror_group)
_pinned_mirrors: list[Any] = []  # early mirror groups of generations that did not form: never freed


class FormationAborted(TransportError):
    """Forming a generation's groups was abandoned (the generation failed or was superseded)."""


def _creator(opts: Any, _backend_opts: Any) -> RebindableGroup:
    ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
    g = RebindableGroup(opts.group_rank, opts.group_size, ranks, opts.timeout)
    g._set_group_name(str(opts.group_id))
    with _lock:
        _registry[str(opts.group_id)] = g
        store, generation = _live["store"], _live["generation"]
    if store is not None and generation is not None:
        # A live rank creating a subgroup (every member calls new_group): connect it now.
        with sockets.recording(generation):
            inner, backends = g.build(store, generation)
        reaper.drop(f"group {g.group_name} rebound", g.install(generation, inner, backends))
    return g


def _register_plugin() -> None:
    if PLUGIN.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(PLUGIN, _creator, extended_api=True, devices=["cpu", "cuda"])


def connect_store(host: str, port: int, timeout_s: float) -> dist.Store:
    """A client of the agent's store (hedged: :mod:`ckptless.worker.store_client`), its operations bounded by
    ``timeout_s`` (the collective timeout) once connected."""
    return store_client.connect(host, port, timeout_s)


def ensure_default_group(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> None:
    """Create the (unbound) default group once per process; no I/O, no peer needed."""
    if dist.is_initialized():
        default = dist.distributed_c10d._get_default_group()
        if not isinstance(default, RebindableGroup):
            raise ConfigError(
                "init_process_group", dist.get_backend(),
                "the default process group was created before ckptless.init(): remove the script's own "
                "init_process_group call (ckptless.init() creates the default group, with the same rank and world "
                "size, and keeps it valid across recoveries)")
        if (default.rank(), default.size()) != (rank, world_size):
            raise ConfigError("rank", rank, f"this process's default group is rank {default.rank()} of "
                                            f"{default.size()}, the job says {rank} of {world_size}")
        return
    _register_plugin()
    with _lock:
        _live.update(store=None, generation=None)
    dist.init_process_group(PLUGIN, store=dist.PrefixStore("ckptless/init/", store), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    dist.init_process_group = _guarded_init_process_group
    dist.distributed_c10d.init_process_group = _guarded_init_process_group


def user_groups() -> list[str]:
    """Names of the groups this process made besides the default one (``new_group``, a mesh)."""
    default = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None
    with _lock:
        return [name for name, g in _registry.items() if g is not default]


def drop_default_group() -> None:
    """Forget the unbound default group, so :func:`ensure_default_group` makes it again under another rank.

    Only for a pre-built spare taking a rank other than its standby one (``worker/adoption.py``):
    a group's rank is fixed when it is made, and nothing is bound or in flight yet.
    """
    if not dist.is_initialized():
        return
    default = dist.distributed_c10d._get_default_group()
    if not isinstance(default, RebindableGroup) or default.bound or user_groups():
        raise ConfigError("default group", default.rank(),
                          "only an unbound ckptless default group with no subgroups can change its rank")
    dist.destroy_process_group()
    default.retire("this group object was made for the pre-built spare's standby rank, before it took another "
                   "rank (--spare-any-rank): use dist.group.WORLD (or no group argument) at call time, not a "
                   "reference kept from the setup")
    with _lock:
        _registry.clear()


_torch_init_process_group = dist.init_process_group


def _guarded_init_process_group(*args: Any, **kwargs: Any) -> None:
    """torch's ``init_process_group``, with a clear error when ckptless already made the default group.

    Why: a ported torchrun script often still calls it after ``ckptless.init()``; torch's own
    message ("trying to initialize the default process group twice!") does not say what to do.
    """
    if dist.is_initialized() and isinstance(dist.distributed_c10d._get_default_group(), RebindableGroup):
        backend = kwargs.get("backend", args[0] if args else None)
        raise ConfigError("init_process_group", backend,
                          "ckptless.init() already created the default process group (same rank and world size, "
                          "kept valid across recoveries): remove this call, or guard it with "
                          "`if not dist.is_initialized():`")
    _torch_init_process_group(*args, **kwargs)


@contextmanager
def local_only() -> Iterator[None]:
    """Every group answers collectives locally inside this block (as an unbound one would).

    Why: restoring some protected state replays what a peer collective did
    (e.g. a DDP reducer rebuilding its buckets broadcasts rank 0's order); every
    rank replays the same captured facts, so the answer is local by construction.
    """
    gs = groups()
    for g in gs:
        g.set_local_only(True)
    try:
        yield
    finally:
        for g in gs:
            g.set_local_only(False)


def groups() -> list[RebindableGroup]:
    with _lock:
        return list(_registry.values())


#: The most polls per second the whole job makes of one barrier counter (each rank polls every
#: max(5 ms, W / POLLS_PER_S), at most every 100 ms): the store's load stays bounded as W grows.
POLLS_PER_S = 100_000


def poll_interval(world_size: int) -> float:
    """How often one rank first polls a barrier's counter: 5 ms up to W = 500, then W / 100,000 s, at most 0.1 s."""
    return min(0.1, max(0.005, world_size / POLLS_PER_S))


#: A rank that keeps waiting polls less and less often, up to this interval (or :func:`poll_interval`
#: where that is longer): ranks that arrived early (the survivors, waiting while a replacement runs its
#: setup) stop spending the CPU the replacement needs. Measured here (issue 35, bench/scale.py at W = 32 on 2
#: cores): with a fixed 5 ms, the 31 waiting survivors made ~6,000 store round trips a second for the
#: ~1 s a replacement's setup took, and that setup was the whole of W = 32's extra recovery time.
SLOW_POLL_S = 0.05
#: How much each further poll's interval grows (a geometric back-off).
POLL_GROWTH = 1.5


def poll_intervals(world_size: int) -> Iterator[float]:
    """The sleeps between one rank's polls of a barrier: :func:`poll_interval` (W) first, growing by
    :data:`POLL_GROWTH` per poll to ``max(SLOW_POLL_S, poll_interval(W))``. A rank leaves at most one
    interval after the last arrival: within 5 ms when all arrive together, within 50 ms (100 ms from
    W = 10,000) after a long wait; a rank waiting T seconds polls about log_1.5(10) + T / 0.05 times."""
    interval = poll_interval(world_size)
    cap = max(SLOW_POLL_S, interval)
    while True:
        yield interval
        interval = min(cap, interval * POLL_GROWTH)


def arrive(store: dist.Store, generation: int, world_size: int, deadline: float, abort: Abort | None = None,
           barrier: str = "arrived") -> None:
    """Wait until every rank of ``generation`` checked in at the store, or ``abort()`` gives a reason.

    ``barrier`` names the check-in (one per formation step of a generation).

    Cost on the store: each rank adds itself once, then polls the counter at :func:`poll_intervals`
    (W): at first every :func:`poll_interval` (W), about 100,000 operations per second for the whole
    job up to W = 10,000 (above it the 0.1 s cap holds, 10 x W per second); a rank that keeps waiting
    backs off to one poll per 50 ms (20 x W per second for the job up to W = 5,000, then the same
    100,000). Before issue 20 every rank polled every 5 ms: 2 million operations per second of
    formation on the one store at W = 10,000; before issue 35's back-off, waiting ranks kept polling
    at the first interval. (Waiting on a key from a second connection per rank was tried and
    measured: 32 simultaneous connects to one store took 5 s, the client's connect back-off; the
    caller's own connection cannot wait in slices without a C++ warning per slice.)
    """
    key = f"ckptless/gen{generation}/{barrier}"
    intervals = poll_intervals(world_size)
    try:
        store.add(key, 1)
        while store.add(key, 0) < world_size:
            why = abort() if abort is not None else None
            if why is not None:
                raise FormationAborted(f"forming generation {generation} abandoned: {why}")
            if time.monotonic() > deadline:
                raise FormationAborted(f"not all {world_size} ranks of generation {generation} arrived in time")
            time.sleep(next(intervals))  # bounded by the deadline above
    except (RuntimeError, OSError) as exc:
        raise TransportError(f"store unreachable while forming generation {generation}: {exc}") from exc


def _abortable(fn: Callable[[], Any], generation: int, deadline: float, abort: Abort | None, what: str) -> Any:
    """Run a blocking collective setup in a thread; give up on ``abort()`` or the deadline."""
    out: list[Any] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            with sockets.recording(generation):  # this generation's connections (shut down when it ends)
                out.append(fn())
        except BaseException as exc:  # reported to the caller below
            error.append(exc)

    worker = threading.Thread(target=run, name=f"ckptless-{what}-g{generation}", daemon=True)
    worker.start()
    exit_guard.watch(worker.is_alive, worker.join)
    try:
        wait_thread(worker, generation, deadline, abort, "communicators did not connect")
    except FormationAborted:
        # The helper may be inside a connect or its check: abort what it built (NCCL: ncclCommAbort
        # ends a non-blocking init in progress); Gloo's connects end with their peers' sockets.
        forming.abort(generation)
        raise
    if error:
        raise TransportError(f"forming generation {generation} failed: {error[0]}") from error[0]
    return out[0]


def wait_thread(worker: threading.Thread, generation: int, deadline: float, abort: Abort | None,
                late: str) -> None:
    """Wait for ``worker`` (a formation step of ``generation`` run off the caller's thread), giving up
    with :class:`FormationAborted` on ``abort()`` or at the deadline ("generation G's <late> in time")."""
    while worker.is_alive():
        worker.join(0.01)
        why = abort() if abort is not None else None
        if why is not None and worker.is_alive():
            raise FormationAborted(f"forming generation {generation} abandoned: {why}")
        if time.monotonic() > deadline and worker.is_alive():
            raise FormationAborted(f"generation {generation}'s {late} in time")


def form_mirror_group(store: dist.Store, generation: int, rank: int, world_size: int, timeout_s: float,
                      deadline: float, abort: Abort | None = None, peers: Sequence[int] = ()) -> dist.ProcessGroup:
    """Form the generation's mirror group ahead of the others (collective); :func:`bind_all` reuses it.

    Why: a recovery's transfers need no user group, so they can run on it
    while a replacement still runs its setup (which must finish before the
    user's groups can form: it may create groups of its own).
    """
    arrive(store, generation, world_size, deadline, abort, barrier="arrived-mirror")
    pg = _abortable(lambda: mirror_group(store, generation, rank, world_size, timeout_s, peers, deadline),
                    generation, deadline, abort, "mirror")
    with _lock:
        # Only the newest generation's is used; an older one is kept referenced, never freed: its
        # failed transfer may have left Gloo operations in flight (see generation._RETIRED_ENGINES).
        _pinned_mirrors.extend(_early_mirror.values())
        _early_mirror.clear()
        _early_mirror[generation] = pg
    return cast(dist.ProcessGroup, pg)


def bind_all(store: dist.Store, generation: int, rank: int, world_size: int, timeout_s: float, deadline: float,
             abort: Abort | None = None, mirror_peers: Sequence[int] = (),
             physical: tuple[int, int] | None = None, phases: dict[str, float] | None = None) -> dist.ProcessGroup:
    """Bind every group of this process to ``generation`` and build its mirror group (collective).

    Returns the generation's mirror group (see :func:`mirror_group`); one formed
    ahead by :func:`form_mirror_group` for this generation is taken as it is.
    ``physical``: this process's ``(index, count)`` in a generation with fewer ranks; every
    communicator then spans the processes (the groups keep their logical ranks and sizes).
    ``phases``, if given, receives where this rank's formation time went (``arrive_s``: waiting at the
    check-in for the last rank; ``connect_s``: building the communicators), for the ledger: a slow
    formation names its phase and, by the arrival times, its last rank.
    """
    if physical is not None:
        rank, world_size = physical
    started = time.monotonic()
    arrive(store, generation, world_size, deadline, abort)
    arrived = time.monotonic()
    chaos_hooks.pause_point(f"bind:r{rank}:g{generation}", rank=rank, generation=generation)  # (chaos runs only)
    todo = groups()
    with _lock:
        early = _early_mirror.pop(generation, None)

    def build() -> tuple[list[tuple[RebindableGroup, Any, list[Any]]], dist.ProcessGroup]:
        built = []
        for g in todo:  # creation order: the same on every rank
            inner, backends = g.build(store, generation, physical)
            built.append((g, inner, backends))
        mirror = early if early is not None else mirror_group(store, generation, rank, world_size, timeout_s,
                                                              mirror_peers, deadline)
        return built, mirror

    built, mirror = _abortable(build, generation, deadline, abort, "bind")
    if phases is not None:
        phases.update(arrive_s=round(arrived - started, 4), connect_s=round(time.monotonic() - arrived, 4))
    old: list[Any] = []
    for g, inner, backends in built:
        old.extend(g.install(generation, inner, backends))
    if old:  # normally nothing: the previous generation was released when it was left
        reaper.drop(f"generation {generation - 1} (rebound)", old)
    with _lock:
        _live.update(store=store, generation=generation)
    return cast(dist.ProcessGroup, mirror)


def release_all(generation: int | None = None) -> reaper.Release:
    """Unbind every group from its communicator at once (peers blocked on us fail promptly) and hand
    the communicators to the reaper; returns without waiting for their destructors.

    The connections of ``generation`` (default: the bound one) and older are shut down first
    (:mod:`ckptless.worker.sockets`): closing alone sends nothing while a forked child (a
    DataLoader worker) holds a copy of a socket, and the destructors, which would close them,
    may not return for a collective timeout (:mod:`ckptless.worker.reaper`). Must run *outside*
    an ``except`` block: a live traceback keeps the failed call's frames, hence its Work and
    the communicator's sockets, alive.
    """
    with _lock:
        bound = _live["generation"]
        _live.update(store=None, generation=None)
    ending = generation if generation is not None else bound
    if ending is not None:
        sockets.shutdown(ending)
    old: list[Any] = []
    for g in groups():
        old.extend(g.release())
    if ending is not None:
        old.extend(forming.forget(ending))
        gloo_peers.forget(ending)
    return reaper.drop(f"generation {ending}", old)


def collective_failed(generation: int, settle_s: float = 0.5) -> bool:
    """Did a collective of ``generation`` fail? (Waits briefly for callbacks of completed futures.)

    Also true when torch's own watchdog saw a failure of one of its communicators (``get_error``):
    in error mode 2 it aborts the communicator by itself, after which the works ``wait()`` on
    report success with garbage in their tensors, and no future fails (measured rule, torch 2.13
    ``ProcessGroupNCCL.cpp`` S2:644-649, 857-926): a step that ran on it must never be protected."""
    end = time.monotonic() + settle_s
    while True:
        gs = groups()
        if any(g.broken_generation == generation or g.backend_error(generation) is not None for g in gs):
            return True
        pending_done = False
        for g in gs:
            with g.lock:
                pending_done = pending_done or any(f.done() for f in g.pending.values())
        if not pending_done or time.monotonic() > end:
            return False
        time.sleep(0.005)


def timed_out(generation: int) -> bool:
    """Did a collective of ``generation`` wait out its timeout (``CollectiveTimeout``)? A worker's report
    says so: two such generations in a row at one resume version end the job (recovery/give_up.py)."""
    return any(g.timed_out_generation == generation for g in groups())


def mirror_group(store: dist.Store, generation: int, rank: int, world_size: int, timeout_s: float,
                 peers: Sequence[int] = (), deadline: float | None = None) -> dist.ProcessGroup:
    """The generation's mirroring communicator: Gloo, separate, lazily connected, NOT registered with c10d.

    Unregistered so that nothing frees it under the background mirror thread
    still inside a Gloo call on it (that aborted a survivor here); it dies with
    its engine instead.

    Lazy, then connected to ``peers`` only (this rank's placement peers, its
    agreement-tree neighbours and its transfer partners: ``worker/mirror_peers.py``):
    2K + FANOUT + 1 connections at most instead of Gloo's full mesh of W - 1,
    and O(peers) store lookups per rank instead of W (W^2 in all). Connected
    here, inside the formation, so that a dead peer aborts the formation and
    the connections are recorded with the generation (shut down when it ends).
    A pair outside ``peers`` still works: it connects on its first message, and
    is ended with its generation too (found by address: ``worker/gloo_peers.py``).
    """
    try:
        mirror_store = dist.PrefixStore(f"ckptless/gen{generation}/mirror/", store)
        others = sorted(set(peers) - {rank})
        recording = gloo_peers.PeerRecordingStore(mirror_store, generation, expect=others)
        pg = new_gloo(recording, rank, world_size, timedelta(seconds=timeout_s), lazy=True)
        if peers:
            left = timeout_s if deadline is None else max(0.001, deadline - time.monotonic())
            agreement.connect(cast(dist.ProcessGroup, pg), others, Deadline(left))
    except (RuntimeError, ValueError) as exc:
        raise TransportError(f"forming generation {generation}'s mirror group failed on rank {rank}: {exc}") from exc
    return cast(dist.ProcessGroup, pg)


if TYPE_CHECKING:  # mypy holds the group to state/'s protocol (a pybind11 base class cannot also subclass one)
    _ANSWERS_LOCALLY: type[AnswersLocally] = RebindableGroup
