"""Growing back from fewer ranks: the processes leave together at an agreed step boundary (issue 22).

Why: a generation with fewer ranks is not mirrored (:mod:`ckptless.worker.hosted`),
so its only consistent state is the live one at a step boundary. When the leader
sees a spare for every hosted rank (a scheduler's new node, admitted as spares), it
asks the generation to grow back (``job/grow/g<G>``). Workers see that request at
different moments, so at every step boundary of such a generation the processes
agree on it with one MAX all-reduce of a flag over the world group (it spans the
processes); when it is set, all of them stop at that same boundary T and hand
their state over where the next plan looks for it:

* each process its own image of version T, kept beside the one of the version
  the generation resumed at (what a survivor rolls back to, and what serves a
  replicated prefix), and with the node-local tier also in its node's memory
  (a process lost before the grown generation commits T leaves it there);
* each host one image of version T per hosted rank (that rank's RNG and data
  position swapped in), put in its peer store as that rank's holder.

They then leave the generation with a fault ("growing back"); the incident's plan
gives the hosted ranks to the spares, which receive those images like any
replacement, bitwise, and the job goes on at full width and mirrored again.

Cost per step of a generation with fewer ranks: one 4-byte all-reduce over the P
processes (O(log P) latency); at the handoff: one capture of the rank's state per
process plus one per hosted rank (the hosted ranks' copies hold their private
suffix only, docs/scale.md).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ckptless.mirror import OwnImageFiles
from ckptless.mirror import StoredImage
from ckptless.state import Capturer
from ckptless.state import Manifest
from ckptless.worker.runtime import WorkerRuntime

log = logging.getLogger(__name__)


def agreed(rt: WorkerRuntime, generation: int) -> bool:
    """Do all processes of ``generation`` grow back at this step boundary? (Collective over the world group.)"""
    asked = rt.control is not None and rt.control.grow_requested(generation)
    flag = torch.tensor([1 if asked else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def capture_own(rt: WorkerRuntime, version: int) -> StoredImage:
    """This process's own image of ``version``, kept (by the driver) beside, not instead of, the version the
    generation resumed at (and its committed mark): a peer lost during the handoff leaves some ranks without
    an image of ``version``, and the plan then falls back to that one."""
    own = rt.capturer.capture(version, rt.generation)
    return StoredImage(own.manifest, own.buffer)


def hand_over(rt: WorkerRuntime, version: int, own: StoredImage) -> None:
    """Put this process's own image (``own``) and its hosted ranks' images of ``version`` where the plan
    finds them."""
    _keep_on_node(rt, own.manifest, own.buffer)
    micro = rt.micro
    if micro is None:
        return
    store = rt.open_peer_store()
    for rank in micro.order():
        capturer = Capturer(rt.registry, rt.ctx.job_id, rank, rt.mirror_config.chunk_bytes,
                            timeout_s=rt.mirror_config.timeout_s, mirror_replicated=rt.capturer.mirror_replicated)
        with micro.state_of(rank):
            image = capturer.capture(version, rt.generation)
        store.put(image.manifest, image.buffer)
        log.info("rank %d: handed hosted rank %d's image of version %d over (%d bytes)", rt.rank, rank, version,
                 image.manifest.total_bytes)


def _keep_on_node(rt: WorkerRuntime, manifest: Manifest, buffer: torch.Tensor) -> None:
    """The node-local tier (``--shm-dir``): this process's image of the handoff version in its node's
    memory too, with its manifest. Why: until the grown generation commits that version again, it
    is this rank's only copy; a process lost in that window (killed while its spares receive) then
    leaves it on its node, where a respawn restores it (R9) or a live process adopts it (R11),
    instead of sending the whole job back to the version it shrank at, or to disk. One copy of S
    per process, once per growth; the next engine's first commit removes it like any older own image.
    """
    if not (rt.ctx.shm_dir and rt.mirror_config.node_local):
        return
    files = OwnImageFiles(rt.ctx.shm_dir, rt.ctx.job_id, rt.ctx.node_id, rt.rank)
    buf, path = files.allocate(manifest.total_bytes)
    if path is None:  # a full shm dir (said once): the image stays in this process's memory only
        return
    buf[: manifest.total_bytes].copy_(buffer[: manifest.total_bytes])
    files.publish(path, manifest)
