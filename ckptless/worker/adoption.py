"""A pre-built spare taking a rank other than the one it built its objects as (any-rank adoption).

Why: a warm spare runs the script's setup as one *standby rank* X before anyone
fails. With one spare per node and W ranks, the lost rank is X only 1 time in
W; every other loss used to restart the spare as the lost rank Y (a re-exec),
putting the script's whole setup back on the critical path. When the script
declares its setup rank-independent (``--spare-any-rank``) and the planner saw
that X's image and Y's image have the same layout key
(:mod:`ckptless.state.layout`), the spare keeps its objects and takes Y: it
receives Y's image into them like any replacement.

What can still tie the built objects to X, and is checked here (a failed check
falls back to the re-exec, which is always correct):

* a rank read by the setup (``worker/rank_reads.py``), seen from the process's
  first line; a spare whose start was not watched is never adopted in place
  (issue 35: a read before ``ckptless.init()`` used to go unseen);
* a process group other than the default one (``new_group`` made while X: its
  membership was decided by X, and it cannot be re-ranked in place);
* a protected DDP model (its reducer holds the default group object it was
  built with); FSDP/DTensor state never gets here: its layout key holds the
  owner rank, so no other rank's image matches it;
* a protected object (or its ``sampler``) with an integer ``rank`` other than
  the new one and no ``set_world`` to change it (a sampler of the standby
  rank's data shard).

What is re-made for Y: the (unbound) default group, so ``dist.get_rank()``
answers Y; ckptless's own resumable data positions (``set_world``); the
snapshot writer. Anything else the script derived from the rank during setup
is its own contract (``docs/configuration.md``, ``--spare-any-rank``).
"""

from __future__ import annotations

import logging
import os
import sys

from ckptless.data import set_world
from ckptless.recovery import RecoveryPlan
from ckptless.recovery import Membership
from ckptless.state import HIDDEN_PREFIX
from ckptless.state import StateRegistry
from ckptless.worker import exit_file, groups, rank_reads
from ckptless.worker.runtime import WorkerRuntime

log = logging.getLogger(__name__)

EXIT_REEXEC = 75  # a pre-built spare assigned another rank: its agent starts it again as that rank


def why_not(registry: StateRegistry, m: Membership, rank: int) -> str | None:
    """Why this pre-built spare may not take ``rank`` with its objects as built (None: it may)."""
    d = m.decision
    if not isinstance(d, RecoveryPlan) or rank not in d.adopt_prebuilt:
        return "the plan did not find its standby rank's layout equal to that rank's"
    read = rank_reads.reads()
    if read:
        return f"its setup read its rank ({read[0]}), so what it built is its standby rank's"
    if not rank_reads.watched_from_start():
        return ("its setup was not watched from its first line (it was not started by ckptless-run with "
                "ckptless/worker/spare_site), so a rank read before ckptless.init() cannot be ruled out")
    extra = groups.user_groups()
    if extra:
        return f"its setup created process groups {extra} as its standby rank"
    ddp = [n for n in registry.names() if n.startswith(HIDDEN_PREFIX)]
    if ddp:
        return f"it protects a DDP model ({ddp[0][len(HIDDEN_PREFIX):]}), whose reducer holds its standby group"
    for name, obj in registry.items():
        for target in (obj, getattr(obj, "sampler", None)):
            held = getattr(target, "rank", None)
            if (type(held) is int and held != rank
                    and not callable(getattr(target, "set_world", None))):  # ours are re-ranked in take_rank
                return f"protected {name!r} holds rank {held} from the setup and cannot be told the new one"
    return None


def why_not_waited(rt: WorkerRuntime, rank: int) -> str | None:
    """Why a spare that waited in ``ckptless.init()`` for its rank (not pre-built) may not take ``rank``
    in this process (None: it may). Until now its ``RANK`` said ``rt.ctx.rank`` (a placeholder), and a
    script that read it before ``init()`` holds that rank's data and seeds (issue 35)."""
    if rank == rt.ctx.rank:
        return None  # what it was told is right (a spare restarted as its rank)
    read = rank_reads.reads()  # all before init() returned: this runs inside it
    if read:
        return f"its script read its rank before ckptless.init() ({read[0]}), when RANK said {rt.ctx.rank}"
    if not rank_reads.watched_from_start():
        return ("its script was not watched from its first line (it was not started by ckptless-run with "
                "ckptless/worker/spare_site), so a rank read before ckptless.init() cannot be ruled out")
    return None


def take_rank(rt: WorkerRuntime, rank: int, world_size: int) -> None:
    """Re-make what the spare's setup made for its standby rank, for ``rank`` (see module doc)."""
    groups.drop_default_group()
    for name, obj in rt.registry.items():
        if set_world(obj, rank, world_size):
            log.info("protected %s now reads the data of rank %d", name, rank)
    rt.renew_snapshot_writer()


def reexec(rt: WorkerRuntime, rank: int | None) -> None:
    """A spare assigned a rank its setup was not made for (its objects and groups, or what its script
    read before ``ckptless.init()``, are another rank's): it ends now and its agent starts it again
    (warm) as that rank, which is always correct."""
    log.warning("spare %s was started as rank %s but assigned rank %s: restarting as rank %s",
                rt.worker_id, rt.ctx.standby_rank if rt.prebuilt else rt.ctx.rank, rank, rank)
    exit_file.write("reexec")
    rt.heartbeat.close()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_REEXEC)  # nothing else runs here: groups unbound, no engine, no snapshot yet
