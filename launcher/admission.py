"""Who may take part in a job: the settings every agent must agree on, and whether the job is over.

Why a module of its own: both are decided before an agent takes part, from
its flags and what etcd holds, and both went wrong in one direction only:
agents that disagreed on ``--replicas`` (or ran other script arguments)
formed one job that hung in its first mirror round, and an agent started
after its job had ended waited for a round that never closed (issue 35,
findings 6 and 3).

* :data:`SETTINGS` classifies every ``LaunchConfig`` field: the job-wide
  settings every agent of a job must be started with (the mirror layout, the
  snapshot schedule, the leader's policies, the script and its arguments), and
  the ones that may differ per node (its size, its addresses, its logs, its own
  spares). :func:`job_config` is an agent's job-wide settings, recorded in the
  rendezvous round by the agent that opens it and compared with every later
  agent's (``coordinator/rendezvous.py``: ``decide_join``, ``check_agreement``).
* :func:`refuse_if_ended` reads the job's ``status`` before the agent writes
  anything: an ended job is reported (one line, the outcome as exit code) and
  left exactly as it is.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ckptless.coordinator.client import EtcdClient
from ckptless.coordinator.keyspace import Keyspace
from ckptless.coordinator.rendezvous import RoundState
from ckptless.errors import JobEnded
from ckptless.launcher.args import LaunchConfig
from ckptless.recovery.view import JobStatus


@dataclass(frozen=True)
class Setting:
    """One command-line setting: the ``LaunchConfig`` fields it covers, and whether every agent of a job
    must agree on it (``agree``) or it may differ per node; ``why`` is the reason (docs/launcher.md)."""

    label: str
    fields: tuple[str, ...]
    agree: bool
    why: str
    value: Callable[[LaunchConfig], Any] | None = None  # its JSON value (default: the one field's)


def _program(cfg: LaunchConfig) -> str:
    """The script as run (``-m``, ``--no-python``, ``--run-path``) with the SHA-256 of its bytes."""
    how = "-m " if cfg.module else "--no-python " if cfg.no_python else "--run-path " if cfg.run_path else ""
    h = hashlib.sha256()
    if not cfg.module and os.path.isfile(cfg.training_script):
        with open(cfg.training_script, "rb") as f:
            h.update(f.read())
        return f"{how}{cfg.training_script} (sha256 {h.hexdigest()[:16]})"
    return f"{how}{cfg.training_script}"


def _per_node(label: str, *fields: str, why: str) -> Setting:
    return Setting(label, fields or (label.lstrip("-").replace("-", "_"),), False, why)


def _agree(label: str, *fields: str, why: str, value: Callable[[LaunchConfig], Any] | None = None) -> Setting:
    return Setting(label, fields or (label.lstrip("-").replace("-", "_"),), True, why, value)


SETTINGS: tuple[Setting, ...] = (
    # --- must agree: the job's shape, its mirrors and snapshots, the leader's policies, the program
    _agree("--nnodes", "min_nodes", "max_nodes", value=lambda c: f"{c.min_nodes}:{c.max_nodes}",
           why="the rendezvous closes on it, and the leader (any agent) keeps at least MIN nodes when it shrinks"),
    _agree("--replicas", why="K: every rank's mirror placement and the leader's plans assume one K"),
    _agree("--mirror-every", why="a mirror round is a collective of every rank: all must hold it at the same steps"),
    _agree("--placement", why="which ranks hold whose mirror: every rank and the leader compute the same map"),
    _agree("--on-replica-mismatch", why="what every rank does when replicas differ: one decision of the whole job"),
    _agree("--mirror-replicated", why="what each rank mirrors: a holder and its owner must agree on the contents"),
    _agree("--snapshot-every", why="a snapshot is complete only when every rank wrote its part at the same step"),
    _agree("--snapshot-dir", why="the ranks' parts and the leader's choice of a snapshot must be in one directory "
                                 "(the same path on every node)"),
    _agree("--fresh-start", why="the whole-job start: node 0 sets old snapshots aside while every other node checks "
                                "them; a node that disagrees refuses, or sees them half moved"),
    _agree("--node-grace", why="the leader's policy (the leader is any agent): how long a node may be without its "
                               "lease before its ranks are re-planned"),
    _agree("--replacement-timeout", why="the leader's policy, and every worker's wait while the job waits"),
    _agree("--lost-node", why="the leader's policy: wait for a replacement, or go on with fewer ranks"),
    _agree("script", "training_script", "module", "no_python", "run_path", value=_program,
           why="every rank runs one program: its path as given, how it is run, and its bytes"),
    _agree("script arguments", "training_script_args", value=lambda c: list(c.training_script_args),
           why="every rank runs one program: the same arguments"),
    # --- may differ per node
    _per_node("--nproc-per-node", "nproc_per_node", "nproc_per_node_spec",
              why="a node's size (a later node with another one serves as that many spares)"),
    _per_node("--rdzv-id/--job-id", "run_id", why="names the job: agents with another id are another job"),
    _per_node("--rdzv-backend", why="all spell the same etcd rendezvous (aliases)"),
    _per_node("--rdzv-endpoint", why="each node's address of the one etcd (any member of its cluster)"),
    _per_node("--rdzv-conf", "rdzv_configs", why="this agent's own waits (join_timeout, last_call_timeout)"),
    _per_node("--standalone", why="one node only"),
    _per_node("--node-rank", why="static backend only (one node)"),
    _per_node("--master-addr", why="static backend only (one node)"),
    _per_node("--master-port", why="this agent's own store port"),
    _per_node("--local-addr", why="this node's own address"),
    _per_node("--max-restarts", why="only TORCHELASTIC_MAX_RESTARTS in this node's workers' environment"),
    _per_node("--monitor-interval", why="this agent's own health-check period"),
    _per_node("--start-method", why="no effect: workers are always fresh processes"),
    _per_node("--event-log-handler", why="refused unless null"),
    _per_node("--role", why="a label in this node's workers' environment (ROLE_NAME)"),
    _per_node("--signals-to-handle", why="what this agent forwards to its own workers"),
    _per_node("--shutdown-timeout", why="how this agent stops its own workers"),
    _per_node("--virtual-local-rank", why="how this node's workers see their GPUs"),
    _per_node("--log-dir", why="where this node's logs go"),
    _per_node("--redirects", why="this node's logs"),
    _per_node("--tee", why="this node's logs"),
    _per_node("--local-ranks-filter", why="this node's console"),
    _per_node("--duplicate-stdout-filters", why="refused when set"),
    _per_node("--duplicate-stderr-filters", why="refused when set"),
    _per_node("--logs-specs", why="refused when set"),
    _per_node("--numa-binding", why="refused when set"),
    _per_node("--spares", why="this node's own spares"),
    _per_node("--goodput-dir", why="where this node's ledger goes"),
    _per_node("--hang-timeout", why="this agent's watchdog over its own workers"),
    _per_node("--lease-ttl", why="this node's own liveness lease"),
    _per_node("--metrics-port", why="this node's own exporter"),
    _per_node("--shm-dir/--no-shm-dir", "shm_dir", why="this node's own node-local tier"),
    _per_node("--no-warm-respawn", "warm_respawn", why="how this agent respawns its own workers"),
    _per_node("--no-spare-prebuild", "spare_prebuild", why="how this node's own spares wait"),
    _per_node("--spare-any-rank/--no-spare-any-rank", "spare_any_rank", why="what this node's own spares may take"),
    _per_node("--spare-refill", why="whether this node starts new spares of its own"),
)


def job_config(cfg: LaunchConfig) -> dict[str, Any]:
    """This agent's job-wide settings, by the names a refusal gives them, as JSON values."""
    return {s.label: (s.value(cfg) if s.value is not None else getattr(cfg, s.fields[0]))
            for s in SETTINGS if s.agree}


# --- an agent after the job's end -----------------------------------------------------------------------------
Admission = Literal["join", "ended", "restart"]


def decide_ended(state: RoundState | None, run_round: int | None, status: JobStatus | None, live_ids: set[str],
                 can_restart: bool) -> Admission:
    """Whether an agent arriving now takes part (``join``), finds its job over (``ended``), or starts the
    ended job again (``restart``: a whole-job relaunch from its snapshots, or ``--fresh-start``).

    ``status`` is the job's end, written once and cleared only when a new run of the id starts (its
    generation 0), so while it exists the job's last run is over, unless a newer round is forming or
    starting (its agents are live): that is a relaunch, and this agent takes part in it. ``run_round``:
    the round the last run started from (None: a run without recovery, which never records one).
    """
    if status is None or state is None:
        return "join"
    live = bool(set(state.ids()) & live_ids)
    newer = run_round is not None and state.round != run_round
    if live and (state.state == "joining" or newer):
        return "join"  # a relaunch is forming or starting: it clears the old run's records
    if live:
        return "ended"  # the ended run's agents are still leaving: nothing to join, nothing to start
    return "restart" if can_restart else "ended"


def can_restart(cfg: LaunchConfig) -> bool:
    """A relaunch of a job that ended: a node with ranks of its own (a spare-only node starts nothing)
    started with ``--fresh-start``, or with a ``--snapshot-dir`` that holds a complete snapshot of it."""
    if cfg.nproc_per_node < 1:
        return False
    if cfg.fresh_start:
        return True
    if not cfg.snapshot_dir:
        return False
    from ckptless.snapshot.restart import stored_snapshots

    return bool(stored_snapshots(cfg.snapshot_dir, cfg.run_id))


def ended_message(job_id: str, status: JobStatus, restartable: bool) -> str:
    """One line: the job is over, how it ended, and what this agent does about it."""
    reason = " ".join(status.reason.split())
    code = 0 if status.state == "succeeded" else 1
    how = "" if restartable or status.state == "succeeded" else (
        " (to run it again: a new --rdzv-id, or --snapshot-dir with its snapshots to resume from them)")
    return (f"job {job_id!r} has already ended: it {status.state} ({reason}); there is nothing to join, "
            f"so this agent exits {code}{how}")


def refuse_if_ended(client: EtcdClient, ks: Keyspace, cfg: LaunchConfig) -> str | None:
    """Raise :class:`JobEnded` when the job this agent would join has ended; reads, never writes.

    Returns a line to print when this agent starts the ended job again (``decide_ended``), else None.
    """
    kv = client.get(ks.status)
    if kv is None:
        return None
    status = JobStatus.from_json(kv.value)
    rdzv, rnd = client.get(ks.rdzv_state), client.get(ks.round)
    state = None if rdzv is None else RoundState.from_bytes(rdzv.value)
    live = {k.key[len(ks.nodes_prefix):] for k in client.get_prefix(ks.nodes_prefix)[0]}
    restartable = can_restart(cfg)
    decision = decide_ended(state, None if rnd is None else int(rnd.value), status, live, restartable)
    if decision == "ended":
        raise JobEnded(ended_message(cfg.run_id, status, restartable), status.state == "succeeded")
    if decision == "restart":
        how = "from step 0 (--fresh-start)" if cfg.fresh_start else f"from its snapshots in {cfg.snapshot_dir}"
        return (f"job {cfg.run_id!r} ended before ({status.state}: {' '.join(status.reason.split())}); this agent "
                f"starts it again {how}, with the agents started with it")
    return None


def recorded_config(client: EtcdClient, ks: Keyspace) -> Mapping[str, Any]:
    """The job-wide settings recorded in the current rendezvous round (empty: none yet)."""
    kv = client.get(ks.rdzv_state)
    return {} if kv is None else RoundState.from_bytes(kv.value).config
