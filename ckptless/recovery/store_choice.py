"""Which store a new generation uses: the one its workers are connected to, while that stays safe (pure).

Why a module of its own: every agent hosts a TCPStore and, until issue 35,
the leader published its own in each generation. When the leader was not the
rendezvous master (about half the jobs), the first recovery moved every worker
to another store: W new connections at once on a server that had none, inside
the recovery (measured at W = 32 here: 13 of the 31 survivors took 5.0 s to
connect in one run; kill -> resumed 5.7 s against 0.8 s), and O(W) connects on
one server at any scale. The store stays where it is as long as its agent runs
ranks of the new generation (a node whose agent is gone has no worker in a
plan: its ranks were moved); otherwise the leader's own, whose host is alive
by definition, as before (docs/scale.md, "Where the generation's store lives").
"""

from __future__ import annotations

from collections.abc import Iterable

Address = tuple[str, int]


def store_for_generation(previous: Address, own: Address, nodes: Iterable[tuple[str, Address]],
                         worker_ids: Iterable[str]) -> Address:
    """``previous`` if a node advertising it (``nodes``: (node id, its store's address), the live agents)
    runs one of ``worker_ids`` (the new generation's workers, ``<node id>/<slot>``); else ``own``."""
    if previous == own:
        return own
    hosts = {node_id for node_id, address in nodes if address == previous}
    if hosts and any(w.split("/", 1)[0] in hosts for w in worker_ids):
        return previous
    return own
