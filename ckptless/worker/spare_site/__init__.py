"""The directory ``ckptless-run`` puts first on the ``PYTHONPATH`` of a node's workers when the node has
spares: its ``sitecustomize`` starts watching a spare's rank reads before the script's first line
(:mod:`ckptless.worker.rank_reads`).

Why a ``sitecustomize``: a script that reads ``RANK`` before ``ckptless.init()`` (at the top of ``main()``,
or in a module-level constant before ``import ckptless``) reads a rank the spare may not take (its
standby rank, or the placeholder of a spare that waits for its rank), and nothing of ckptless
runs before that line in a process started as ``python -u script``. Python imports ``sitecustomize`` from
the path at start-up, before the script: the one place a cold start can be watched from without changing
the command. Every worker of such a node gets the same ``PYTHONPATH`` (members too; the hook does nothing
in them), so a respawn still matches the fork server's start-up environment and is forked warm.
"""

from __future__ import annotations

import os

DIR = os.path.dirname(os.path.abspath(__file__))


def pythonpath(existing: str | None) -> str:
    """``PYTHONPATH`` with this directory first (once), then ``existing``."""
    rest = [p for p in (existing or "").split(os.pathsep) if p and os.path.abspath(p) != DIR]
    return os.pathsep.join([DIR, *rest])
