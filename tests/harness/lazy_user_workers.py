"""Worker processes for tests/e2e/test_lazy_user_gloo.py: the user's lazily connected Gloo group.

Each rank builds its group the product's way (``rebindable.new_user_gloo``:
lazy, its store lookups recorded, the usual collectives' pairs connected
inside the formation), runs a step of the warmed collectives (allreduce,
barrier), then ranks 0 and ``LATE`` exchange a message over a pair
nothing connected before (a connection that opens in the user's step, after
the formation). Both then block on a receive from each other that never comes,
and one of them ends the generation (``sockets.shutdown``): both receives must
fail at once, not after Gloo's timeout. A forked child must hold no copy of the
late connection. Results go to ``out_dir/rank{r}.json``; synchronisation is by
the store and the group's own messages, never by sleeps.
"""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ckptless.worker import rebindable, sockets

from .fds import fd_open

LATE = 3  # no partner of rank 0 in a ring, a binomial tree from 0, or a dissemination barrier at W = 6
TIMEOUT_S = 30.0  # Gloo's own: what a receive would wait without the shutdown


def _far_ends() -> dict[int, tuple[int, int]]:
    """{fd: (near port, far port)} of this process's TCP connections."""
    import socket

    out = {}
    for fd in sockets.socket_fds():
        try:
            with socket.socket(fileno=os.dup(fd)) as s:
                out[fd] = (int(s.getsockname()[1]), int(s.getpeername()[1]))
        except (OSError, IndexError, TypeError):
            continue
    return out


def run(rank: int, world: int, store_path: str, out_dir: str, closer: int) -> None:
    out: dict[str, Any] = {}
    try:
        store = dist.FileStore(store_path, world)
        with sockets.recording(0):
            pg = rebindable.new_user_gloo(dist.PrefixStore("g0/", store), 0, rank, world,
                                          timedelta(seconds=TIMEOUT_S))
        formed = set(sockets.connections(0))
        out["formed"] = len(formed)
        out["listener_ports"] = sorted(sockets._listener_ports.get(0, ()))
        # The step: the collectives the formation warmed. Not always no new connection: in about half
        # the runs here one rank held a fifth (Gloo's lazy pairs are connected from both ends at once).
        t = torch.full((1,), float(rank))
        pg.allreduce([t]).wait()
        pg.barrier().wait()
        out["after_step"] = len(sockets.connections(0))
        out["sum_ok"] = bool(torch.equal(t, torch.full((1,), float(sum(range(world))))))
        if rank in (0, LATE):
            peer = LATE if rank == 0 else 0
            msg = torch.tensor([rank])
            if rank == 0:
                pg.send([msg], peer, 1).wait()
            else:
                pg.recv([msg], peer, 1).wait()
                out["late_message"] = int(msg.item())
            late = set(sockets.connections(0)) - formed  # opened after the formation (in the step or now)
            out["late_connections"] = len(late)
            out["peer_listeners"] = sorted(p for _, p in sockets._peer_listeners.get(0, ()))
            out["far_ports"] = sorted({far for fd, (_, far) in _far_ends().items() if fd in late})
            out["child_kept_late"] = _child_keeps(sorted(late))
            # Both block on a message that never comes; `closer` ends the generation.
            store.set(f"blocked{rank}", "1")
            waiter = pg.recv([torch.zeros(1)], peer, 2)
            if rank == closer:
                store.wait([f"blocked{peer}"])
                threading.Thread(target=sockets.shutdown, args=(0,)).start()  # this rank's own recv is posted
            t0 = time.monotonic()
            try:
                waiter.wait()
                out["blocked_recv"] = "returned"
            except RuntimeError as exc:
                out["blocked_recv"] = f"failed: {str(exc).splitlines()[0][:160]}"
            out["blocked_for_s"] = time.monotonic() - t0
        store.set(f"done{rank}", "1")
        store.wait([f"done{r}" for r in range(world)])
    except Exception:
        out["error"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    os._exit(0)  # the group's threads may still be in Gloo calls on ended connections


def _child_keeps(fds: list[int]) -> bool:
    """Does a forked child still hold any of ``fds`` (the fork handler should have closed them)?"""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        kept = any(fd_open(fd) for fd in fds)
        os.write(w, b"1" if kept else b"0")
        os._exit(0)
    os.close(w)
    answer = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    return answer == b"1"
