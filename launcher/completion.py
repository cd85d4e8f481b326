"""How a node's part in the job ends, as I/O: the job's status record read, this agent's outcome, the failure it prints.

Why a module of its own: when to leave is the agent's most consequential
decision and the one with the most cases, and it is taken by the node's
machine (launcher/node_machine.py: ``node_part``, the Tick transition), from
facts alone. What remains here is what that decision needs from the outside
world and leaves to it: the status record read once at the start, the
outcome the agent returns, and the root cause printed when the job failed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ckptless.launcher.node_machine import node_part
from ckptless.launcher.node_state import NodeState
from ckptless.launcher.summary import render_failure
from ckptless.recovery import ExitRecord, JobStatus

__all__ = ["AgentOutcome", "node_part", "print_failure", "read_status"]


class AgentOutcome:
    def __init__(self, exit_code: int, failed_ranks: tuple[int, ...]) -> None:
        self.exit_code = exit_code
        self.failed_ranks = failed_ranks


def read_status(st: NodeState) -> JobStatus | None:
    assert st.client is not None
    kv = st.client.get(st.keyspace.status)
    return None if kv is None else JobStatus.from_json(kv.value)


def print_failure(st: NodeState, status: JobStatus, local_failures: Sequence[ExitRecord]) -> None:
    lr = {s.rank: s.local_rank for s in st.slots.all() if s.rank is not None}
    text = render_failure(st.cfg.training_script, status, local_failures, lr)
    print(text, file=sys.stderr, flush=True)
