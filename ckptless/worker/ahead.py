"""A recovery's transfers run ahead of the user's groups (and, for a replacement, of its setup).

Why a module of its own: when a generation made by a recovery plan moves
images between ranks, the bytes need no user object, only the generation's
mirror group. So they move before the user's groups form, and a respawned
replacement receives its image on a thread while its script runs its setup
(the survivors wait for that setup anyway). What the transfers brought is
kept on the :class:`~ckptless.worker.generation.Generation` for its restore.
"""

from __future__ import annotations

import threading
import time

from ckptless import chaos_hooks
from ckptless.errors import TransportError
from ckptless.recovery import RecoveryPlan
from ckptless.recovery import adopt_copies
from ckptless.recovery import Received, execute_transfers
from ckptless.recovery import Membership
from ckptless.worker import exit_guard, groups
from ckptless.worker.generation import Generation
from ckptless.worker.mirror_peers import mirror_peers
from ckptless.worker.runtime import TransferAhead, WorkerRuntime


def abort_reason(rt: WorkerRuntime, generation: int) -> str | None:
    """Why a wait inside ``generation`` should stop now (None: keep waiting)."""
    c = rt.control
    if c is None:
        return None
    if c.ended is not None:
        return "the job ended"
    if c.incident(generation):
        return f"generation {generation} was declared failed"
    if c.superseded(generation):
        return "a newer generation was published"
    return None


def runs_ahead(m: Membership) -> bool:
    """Does generation ``m`` run its plan's transfers on its mirror group before the other groups
    form? Every rank decides the same from the same plan."""
    d = m.decision
    return isinstance(d, RecoveryPlan) and bool(d.transfers) and not d.node_local


def start_during_setup(rt: WorkerRuntime) -> TransferAhead | None:
    """A respawned replacement: receive its image while the script runs its setup.

    Called by ``init()`` once the membership that names it is known and before
    the script builds its objects. The thread's outcome is collected by
    :func:`run_or_collect` in ``run()``; the driver keeps what this returns (``rt.transfer_ahead``).
    """
    m = rt.seen
    if m is None or not runs_ahead(m) or rt.replicas == 0:
        return None
    deadline = time.monotonic() + rt.ctx.recovery_timeout_s

    def work() -> None:
        try:
            ahead.received = _transfer_now(rt, m, deadline)
        except BaseException as exc:  # handed to the main thread in run()
            ahead.error = exc

    t = threading.Thread(target=work, name=f"ckptless-transfer-g{m.generation}", daemon=True)
    ahead = TransferAhead(m.generation, t)
    exit_guard.watch(t.is_alive, t.join)
    t.start()
    return ahead


def _transfer_now(rt: WorkerRuntime, m: Membership, deadline: float) -> Received | None:
    rank = m.rank_of(rt.worker_id)
    assert rank is not None and isinstance(m.decision, RecoveryPlan)
    # R11 first, before waiting for the others: a copy this survivor takes from its node's memory serves
    # stripes below, and is held (and reported) even if this generation never forms.
    adopt_copies(m.decision, rt.worker_id, rt.peer_store, rt.ctx.shm_dir or None, rt.ctx.job_id, rt.ctx.node_id,
                 for_transfers=True)
    pg = groups.form_mirror_group(rt.store_for(m), m.generation, rank, m.world_size, rt.ctx.collective_timeout_s,
                                  deadline, lambda: abort_reason(rt, m.generation),
                                  peers=mirror_peers(m, rank, rt.replicas, rt.mirror_config.placement))
    chaos_hooks.pause_point(f"transfers:r{rank}", rank=rank, generation=m.generation)  # chaos runs only
    try:
        return execute_transfers(m.decision, m, rt.worker_id, rt.peer_store, rt.ctx.collective_timeout_s,
                                 into=rt.standby_buffers[0] if rt.standby_buffers else None, group=pg,
                                 own=rt.own_images)
    except RuntimeError as exc:  # a raw Gloo call on the mirror group: a peer failed
        raise TransportError(f"transfers of generation {m.generation} failed: {exc}") from exc


def takes_ahead(rt: WorkerRuntime, m: Membership) -> bool:
    """Does forming ``m`` run its transfers here, taking those started during the setup (``rt.transfer_ahead``)?"""
    return runs_ahead(m) and rt.replicas > 0


def run_or_collect(rt: WorkerRuntime, gen: Generation, deadline: float) -> None:
    """Run (or, for a replacement, collect) the plan's transfers before the user's groups form;
    what they received is kept on ``gen``. The transfers started during the setup are taken (the
    caller's change clears ``rt.transfer_ahead``)."""
    m = gen.membership
    if not takes_ahead(rt, m):
        return
    ahead = rt.transfer_ahead
    if ahead is not None and ahead.generation == m.generation:
        groups.wait_thread(ahead.thread, m.generation, deadline, lambda: abort_reason(rt, m.generation),
                           "transfers did not finish")
        if ahead.error is not None:
            raise ahead.error
        received = ahead.received
    else:
        received = _transfer_now(rt, m, deadline)
    gen.transfers_done, gen.received = True, received
