"""The mirror group connects only the pairs it uses, and agrees over a tree (issue 20).

Real Gloo, one spawned process per rank, the product's own formation
(``groups.mirror_group``), peers (``worker/mirror_peers.py``), engine and tree
reduction. What is guarded: a rank's mirror connections are O(K + FANOUT), not
W - 1; no connection opens after formation (every one is recorded, so it is
shut down with its generation); the MISSING exchange and the commit agree
without a whole-world collective; a peer that dies before connecting costs the
formation its deadline, not Gloo's 5 x timeout, and the next generation forms.
"""

from __future__ import annotations

import json
import multiprocessing as mp
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ckptless.mirror import tree

from ..harness import lazy_mirror_workers as workers

WORLD = 6  # depth 2 with FANOUT 4: rank 0 -> 1..4, 1 -> 5


def _spawn(target: Callable[..., None], world: int, tmp: Path, timeout: float) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, world, str(tmp / "store"), str(tmp))) for r in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout)
            assert not p.is_alive(), "a rank hung past its join timeout"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    out = []
    for r in range(world):
        path = tmp / f"rank{r}.json"
        out.append(json.loads(path.read_text()) if path.exists() else {})
    return out


@pytest.fixture(scope="module")
def six(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    res = _spawn(workers.rounds_entry, WORLD, tmp_path_factory.mktemp("lazy6"), 120)
    for r, x in enumerate(res):
        assert "error" not in x, f"rank {r}:\n{x['error']}"
    return res


def test_connections_follow_placement_and_tree(six: list[dict[str, Any]]) -> None:
    for r, x in enumerate(six):
        assert set(x["placement_peers"]) <= set(x["peers"]), "the engine's placement differs from formation's"
        assert set(tree.neighbours(r, WORLD)) <= set(x["peers"])
        assert len(x["peers"]) <= 2 * workers.K + tree.FANOUT + 1
        # one connection per peer (Gloo's lazy pairs), nothing to the W - 1 - peers others
        assert x["connections"] == len(x["peers"]), x
        assert x["new_after_rounds"] == [], "a connection opened after formation (unrecorded, never shut down)"


def test_rounds_commit_and_missing_moves_nothing_held(six: list[dict[str, Any]]) -> None:
    for x in six:
        assert x["committed"] == 3
        assert x["missing_pairs"] == [] and x["missing_sent"] == 0


def test_tree_reduction_is_the_world_min_and_max(six: list[dict[str, Any]]) -> None:
    for x in six:
        assert x["min"] == [0, 100 - (WORLD - 1)]
        assert x["max"] == [WORLD - 1, 100]


def test_peer_dead_before_connecting_aborts_formation_at_its_deadline(tmp_path: Path) -> None:
    res = _spawn(workers.dead_peer, 4, tmp_path, 90)
    dead = 3
    assert any(dead in x["peers"] for x in res[:-1])
    for r, x in enumerate(res[:-1]):
        assert "error" not in x, f"rank {r}:\n{x.get('error')}"
        if dead in x["peers"]:  # it waited on the dead rank's connection
            assert "formed" not in x, "a mirror group connected to a dead rank"
        # Aborted at its 3 s deadline (a rank whose peer sits in Gloo's connect waits on that peer too);
        # Gloo alone would have waited 5 x 20 s in its connect.
        assert x.get("formed") or x["aborted_after_s"] < 15, x
        assert x["reduced"] == [2] and x["next_generation_s"] < 15, x
