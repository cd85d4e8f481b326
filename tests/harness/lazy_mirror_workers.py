"""Worker processes for tests/e2e/test_mirror_lazy.py: the product's lazy mirror group on real Gloo.

Each rank forms ``groups.mirror_group`` over a FileStore with the peers
``worker/mirror_peers.py`` gives it, runs mirror rounds and tree reductions on
it, and writes what it saw (sockets recorded at formation, sockets open after
the rounds, results) to ``out_dir/rank{r}.json``. Synchronisation is by the
group's own messages and the store, never by sleeps.
"""

from __future__ import annotations

import json
import os
import time
import traceback
from typing import Any

import torch.distributed as dist

from ckptless.errors import TransportError
from ckptless.mirror import MISSING, MirrorEngine, PeerStore
from ckptless.mirror.agreement import tree_allreduce
from ckptless.mirror.transport import Deadline
from ckptless.recovery.decision import Assignment
from ckptless.recovery.wire import Membership
from ckptless.worker import groups, sockets
from ckptless.worker.groups import FormationAborted
from ckptless.worker.mirror_peers import mirror_peers

from .mirror import fill, mirror_config

JOB = "lazy-job"
K = 2
N = 64 * 4096


def _membership(generation: int, world: int) -> Membership:
    return Membership(generation, world, "localhost", 0,
                      tuple(Assignment(r, f"w{r}", f"node{r % 3}", "survivor") for r in range(world)))


def _connections(recorded: dict[int, int]) -> int:
    """How many of the recorded sockets are connections (not the listener)."""
    return sum(1 for fd in recorded if _is_connection(fd))


def _is_connection(fd: int) -> bool:
    import socket

    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            return s.type == socket.SOCK_STREAM and not s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    except OSError:
        return False


def rounds(rank: int, world: int, store_path: str, out_dir: str) -> None:
    out: dict[str, Any] = {}
    try:
        store = dist.FileStore(store_path, world)
        m = _membership(0, world)
        peers = mirror_peers(m, rank, K, "ring")
        deadline = time.monotonic() + 60
        with sockets.recording(0):
            pg = groups.mirror_group(store, 0, rank, world, 20.0, peers, deadline)
        formed = sockets.recorded(0)
        out.update(peers=peers, recorded=len(formed), connections=_connections(formed))
        eng = MirrorEngine(pg, JOB, mirror_config(replicas=K), generation=0, node_of=[a.node_id for a in m.ranks],
                           store=PeerStore(JOB, 0))
        out["placement_peers"] = sorted(set(eng.placement.holders(rank)) | set(eng.placement.owners_held_by(rank)))
        for v in (1, 2, 3):
            eng.submit(*fill(eng, v, N, job=JOB))
            assert eng.wait_committed(v, timeout=30)
        eng.submit(*fill(eng, 3, N, job=JOB), pairs=MISSING)  # every holder keeps v3: nothing moves
        assert eng.wait_idle(timeout=30)
        last = eng.history[-1]
        out.update(committed=eng.committed_version, missing_pairs=sorted(last.pairs or ()),
                   missing_sent=last.bytes_sent)
        d = Deadline(20)
        out["min"] = tree_allreduce(pg, rank, world, [rank, 100 - rank], "min", d, "test")
        out["max"] = tree_allreduce(pg, rank, world, [rank, 100 - rank], "max", d, "test")
        after = sockets.socket_fds()
        out["new_after_rounds"] = sorted(set(after) - set(formed) - set(_before_formation))
        eng.close()
    except Exception:
        out["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


_before_formation: dict[int, int] = {}


def rounds_entry(rank: int, world: int, store_path: str, out_dir: str) -> None:
    _before_formation.update(sockets.socket_fds())  # the FileStore and anything torch opened at import
    rounds(rank, world, store_path, out_dir)


def dead_peer(rank: int, world: int, store_path: str, out_dir: str) -> None:
    """The last rank dies before it connects (pytorch/gloo#520's case): the others' formation of the
    lazy group is abandoned at its deadline, and a new generation without it forms at once."""
    out: dict[str, Any] = {}
    try:
        store = dist.FileStore(store_path, world)
        if rank == world - 1:  # checks in as groups.arrive does (its peers pass the barrier), then dies
            dist.PrefixStore("g0/", store).add("ckptless/gen0/arrived-mirror", 1)
            os._exit(0)
        peers = mirror_peers(_membership(0, world), rank, 1, "ring")
        out["peers"] = peers
        t0 = time.monotonic()
        try:
            groups.form_mirror_group(dist.PrefixStore("g0/", store), 0, rank, world, 20.0, time.monotonic() + 3,
                                     peers=peers)
            out["formed"] = True
        except (FormationAborted, TransportError) as exc:
            out["aborted_after_s"] = time.monotonic() - t0
            out["why"] = str(exc)
        survivors = world - 1
        t1 = time.monotonic()
        pg = groups.mirror_group(dist.PrefixStore("g1/", store), 1, rank, survivors, 20.0,
                                 mirror_peers(_membership(1, survivors), rank, 1, "ring"), time.monotonic() + 20)
        out["reduced"] = tree_allreduce(pg, rank, survivors, [rank], "max", Deadline(20), "test")
        out["next_generation_s"] = time.monotonic() - t1
    except Exception:
        out["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    os._exit(0)  # the abandoned formation's thread may still sit in Gloo's connect (up to 5 x its timeout)
