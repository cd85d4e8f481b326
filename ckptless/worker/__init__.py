"""ckptless.worker: what runs inside a training process launched by ``ckptless-run``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptless import lazy

__all__ = [
    "WorkerContext", "WorkerDriver", "read_progress", "WorkerLedger", "leader_sink", "Event", "State", "UserError",
    "is_terminal", "RunResult", "RunSpec", "device", "exit_file", "exit_guard", "groups", "nccl_env", "rank_reads",
    "setup_seed", "spare_site", "training",
]


# Imported on first use (ckptless/lazy.py): an importer of one module pays for no other.
if TYPE_CHECKING:
    from ckptless.worker.context import WorkerContext
    from ckptless.worker.driver import WorkerDriver
    from ckptless.worker.heartbeat import read_progress
    from ckptless.worker.ledger import WorkerLedger, leader_sink
    from ckptless.worker.machine import Event, State, UserError, is_terminal
    from ckptless.worker.runtime import RunResult, RunSpec

__getattr__ = lazy.exports(__name__, {
    "context": "WorkerContext",
    "driver": "WorkerDriver",
    "heartbeat": "read_progress",
    "ledger": "WorkerLedger leader_sink",
    "machine": "Event State UserError is_terminal",
    "runtime": "RunResult RunSpec",
})
