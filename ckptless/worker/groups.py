"""Process groups of one generation, formed from the store the agent hosts.

Why per generation: after a failure the survivors re-form their groups in the
same process. Every generation's keys live under their own ``PrefixStore`` so
no rank ever reads a previous round's rendezvous keys (torchrun's shared store
broke exactly that way here), and the store lives in the long-lived agent,
never in a worker. Two groups: the training group (the default group, what
user code and DDP use) and a separate mirroring group driven by a background
thread, so mirroring never interleaves with training collectives.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast
from datetime import timedelta

import torch.distributed as dist

from ckptless.errors import TransportError

log = logging.getLogger(__name__)


@dataclass
class Groups:
    generation: int
    rank: int
    world_size: int
    mirror: dist.ProcessGroup


def backend_for_device() -> str:
    """Gloo for CPU state; NCCL is used for training only when CUDA is present (not run here)."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def connect_store(host: str, port: int, timeout_s: float) -> dist.Store:
    try:
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), use_libuv=True)
    except (RuntimeError, OSError) as exc:
        raise TransportError(f"cannot reach the agent's store at {host}:{port}: {exc}") from exc


def arrive(store: dist.Store, generation: int, world_size: int, timeout_s: float,
           abort: Callable[[], bool] | None = None) -> None:
    """Wait until every rank of ``generation`` arrived at the store, or ``abort()`` says to give up.

    Why not let ``init_process_group`` wait: it blocks in C++ until its timeout
    when a peer never comes (it died during the recovery), and nothing can
    interrupt it. This barrier polls the store and the coordinator's incident
    flag, so a second failure during recovery is noticed at once.
    """
    key = f"ckptless/gen{generation}/arrived"
    deadline = time.monotonic() + timeout_s
    try:
        store.add(key, 1)
        while store.add(key, 0) < world_size:
            if abort is not None and abort():
                raise TransportError(f"generation {generation} was declared failed while forming its groups")
            if time.monotonic() > deadline:
                raise TransportError(f"not all {world_size} ranks of generation {generation} arrived within {timeout_s}s")
            time.sleep(0.005)  # store polling interval; bounded by the deadline above
    except (RuntimeError, OSError) as exc:
        raise TransportError(f"store unreachable while forming generation {generation}: {exc}") from exc


def form_groups(store: dist.Store, generation: int, rank: int, world_size: int, timeout_s: float,
                abort: Callable[[], bool] | None = None, arrive_timeout_s: float | None = None) -> Groups:
    """Initialise the default (training) group and the mirror group for ``generation``.

    ``arrive_timeout_s`` bounds the wait for every rank to show up; it is the
    recovery deadline, longer than a collective's, because a cold replacement
    may need many seconds just to import torch on a loaded node.
    """
    arrive(store, generation, world_size, arrive_timeout_s or timeout_s, abort)
    prefixed = dist.PrefixStore(f"ckptless/gen{generation}/", store)
    try:
        dist.init_process_group(
            backend=backend_for_device(),
            store=prefixed,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        # Mirroring moves CPU tensors: always Gloo, on its own communicator, and NOT
        # registered with c10d: destroy_process_group() then leaves it alone, so a
        # mirror thread still inside a Gloo call on it is never freed under its
        # feet (that aborted a survivor here). It dies with its engine instead.
        mirror = dist.ProcessGroupGloo(
            dist.PrefixStore(f"ckptless/gen{generation}/mirror/", store), rank, world_size,
            timedelta(seconds=timeout_s),
        )
    except (RuntimeError, ValueError) as exc:
        raise TransportError(f"forming generation {generation} groups failed on rank {rank}: {exc}") from exc
    # Duck-typed: a Gloo backend offers rank/size/send/recv/allreduce like a ProcessGroup.
    return Groups(generation, rank, world_size, cast(dist.ProcessGroup, mirror))


def destroy_groups() -> None:
    """Drop every group at once (frees sockets so blocked peers raise promptly).

    Must be called *outside* an ``except`` block: a live traceback keeps the
    failed collective's frames, hence the group's sockets, alive.
    """
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError):
            log.debug("destroy_process_group raised", exc_info=True)
