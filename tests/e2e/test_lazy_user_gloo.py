"""The user's Gloo groups connect lazily, and a connection opened after the formation is still
ended with its generation (issue 20).

Real Gloo, one spawned process per rank, the product's own construction
(``rebindable.new_user_gloo``). What is guarded: the formation connects only the
pairs of the usual collectives, not Gloo's full mesh; a pair first used in the
user's step connects then (lazily), is found by address (the peer listener Gloo
looked up, or this rank's own listener), and ``sockets.shutdown`` ends it, so a
receive blocked on it fails at once, on both ends, instead of after Gloo's
timeout; a forked child holds no copy of it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from ..harness import lazy_user_workers as workers
from .test_mirror_lazy import _spawn

WORLD = 6


def _check(res: list[dict[str, Any]]) -> None:
    for r, x in enumerate(res):
        assert "error" not in x, f"rank {r}:\n{x.get('error')}"
        assert x["sum_ok"], x
        assert x["formed"] < WORLD - 1, x  # not Gloo's full mesh
    zero, late = res[0], res[workers.LATE]
    assert late["late_message"] == 0
    # The pair opened after the formation, found on both ends (each by its own rule: the dialled peer
    # listener, or its own listener's port).
    assert zero["late_connections"] >= 1 and late["late_connections"] >= 1, (zero, late)
    # Rank 0 looked rank LATE up in the store, and the record parsed to LATE's real listener. Which end
    # dials is Gloo's business (both ends look the pair up on first use; it varied between runs here):
    # each end found the one connection by its own rule, above.
    assert set(late["listener_ports"]) & set(zero["peer_listeners"]), (zero, late)
    for x in (zero, late):
        assert not x["child_kept_late"], "a forked child kept a copy of the late connection"
        assert x["blocked_recv"].startswith("failed"), x
        assert x["blocked_for_s"] < workers.TIMEOUT_S / 3, x  # ended by the shutdown, not Gloo's timeout


def test_connection_opened_after_formation_is_ended_with_its_generation(tmp_path: Path) -> None:
    # Rank 0 dialled the late pair and ends the generation; each end finds the connection by its own
    # rule ("late_connections" on rank 0: the peer listener; on rank LATE: its own listener port).
    res = _spawn(functools.partial(workers.run, closer=0), WORLD, tmp_path, 120)
    _check(res)
