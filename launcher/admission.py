"""Who may take part in a job: the settings every agent must agree on, and whether the job is over.

Why a module of its own: both are decided before an agent takes part, from
its flags, its environment and what etcd holds, and both went wrong in one
direction only: agents that disagreed on ``--replicas`` (or ran other script
arguments) formed one job that hung in its first mirror round, and an agent
started after its job had ended waited for a round that never closed (issue
35, findings 6 and 3).

* :data:`SETTINGS` classifies every ``LaunchConfig`` field, and
  :data:`ENV_SETTINGS` every ``CKPTLESS_*`` variable a user sets: the job-wide
  settings every agent of a job must be started with (the mirror layout, the
  snapshot schedule, the leader's policies, the script and its arguments, the
  seed, the collectives' deadline and backends), and the ones that may differ
  per node (its size, its addresses, its logs, its own spares). :func:`job_config`
  is an agent's job-wide settings, recorded in the rendezvous round by the agent
  that opens it and compared with every later agent's
  (``coordinator/rendezvous.py``: ``decide_join``, ``check_agreement``).
* :func:`admit` reads the job's records before the agent writes anything (its
  lease, its node key, its leader campaign) and decides (:func:`decide_admission`,
  pure): take part; refuse an agent that disagrees with a live round; report an
  ended job (one line, its outcome as the exit code) and leave it exactly as it
  is; refuse an agent whose settings are not the ended run's (another job
  reusing the id); or relaunch a failed job, bounded by a short window.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ckptless.coordinator import EtcdClient
from ckptless.coordinator import Keyspace
from ckptless.coordinator import RoundState, config_disagreement
from ckptless.environment import DEFAULT_SEED, ProcessEnv
from ckptless.errors import JobAlreadyEnded, OtherRunSettings
from ckptless.launcher.args import LaunchConfig
from ckptless.recovery import JobStatus


@dataclass(frozen=True)
class Setting:
    """One command-line setting: the ``LaunchConfig`` fields it covers, and whether every agent of a job
    must agree on it (``agree``) or it may differ per node; ``why`` is the reason (docs/launcher.md)."""

    label: str
    fields: tuple[str, ...]
    agree: bool
    why: str
    value: Callable[[LaunchConfig], Any] | None = None  # its JSON value (default: the one field's)


def _path(p: str) -> str:
    """A path as compared: absolute and normalised (``snaps/``, ``./snaps`` and ``$PWD/snaps`` agree).
    Symlinks are not resolved: a link may lead elsewhere on another node, and the path given is what
    every node's processes open."""
    return os.path.normpath(os.path.abspath(p))


def _program(cfg: LaunchConfig) -> str:
    """The script as run (``-m``, ``--no-python``, ``--run-path``) with the SHA-256 of its bytes; a file's
    path as :func:`_path` gives it (a module name or a ``--no-python`` command as given)."""
    how = "-m " if cfg.module else "--no-python " if cfg.no_python else "--run-path " if cfg.run_path else ""
    h = hashlib.sha256()
    if not cfg.module and os.path.isfile(cfg.training_script):
        with open(cfg.training_script, "rb") as f:
            h.update(f.read())
        where = cfg.training_script if cfg.no_python else _path(cfg.training_script)
        return f"{how}{where} (sha256 {h.hexdigest()[:16]})"
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
                                 "(the same path on every node, compared absolute and normalised)",
           value=lambda c: _path(c.snapshot_dir) if c.snapshot_dir else c.snapshot_dir),
    _agree("--fresh-start", why="the whole-job start: node 0 sets old snapshots aside while every other node checks "
                                "them; a node that disagrees refuses, or sees them half moved"),
    _agree("--node-grace", why="the leader's policy (the leader is any agent): how long a node may be without its "
                               "lease before its ranks are re-planned"),
    _agree("--replacement-timeout", why="the leader's policy, and every worker's wait while the job waits"),
    _agree("--lost-node", why="the leader's policy: wait for a replacement, or go on with fewer ranks"),
    _agree("script", "training_script", "module", "no_python", "run_path", value=_program,
           why="every rank runs one program: its path (absolute, normalised), how it is run, and its bytes"),
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
    _per_node("--log-line-prefix-template", why="refused when set"),
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


@dataclass(frozen=True)
class EnvSetting:
    """One environment variable a user sets for a job: must every agent's be the same (``agree``)? The
    value compared is the one the processes use (:class:`~ckptless.environment.ProcessEnv`'s, or the
    variable's default when unset), so an unset variable and its default agree."""

    label: str
    agree: bool
    why: str
    value: Callable[[ProcessEnv, Mapping[str, str]], Any] | None = None


def _mirror_buffers(_env: ProcessEnv, raw: Mapping[str, str]) -> Any:
    value = raw.get("CKPTLESS_MIRROR_BUFFERS") or "2"  # the workers' default (worker/context.py)
    try:
        return int(value)
    except ValueError:
        return value  # refused by every worker at start; compared as written meanwhile


def _seed(env: ProcessEnv, _raw: Mapping[str, str]) -> Any:
    return DEFAULT_SEED if env.seed is None else env.seed


def _env_node(label: str, why: str) -> EnvSetting:
    return EnvSetting(label, False, why)


#: Every variable ``ckptless/environment.py`` reads, and the two the workers read themselves
#: (``worker/context.py``) that a user sets; the ones ckptless-run sets from its flags are the flags'.
ENV_SETTINGS: tuple[EnvSetting, ...] = (
    EnvSetting("CKPTLESS_SEED", True, "the seed of every rank's unseeded setup: replicas built from other seeds "
               "differ at once (a replica mismatch), a replacement's setup draws what the original's did", _seed),
    EnvSetting("CKPTLESS_COLLECTIVE_TIMEOUT", True, "the deadline of every rank's collectives and mirror rounds, and "
               "the leader's report deadline (the leader is any agent)",
               lambda e, _r: 60.0 if e.collective_timeout_s is None else e.collective_timeout_s),
    EnvSetting("CKPTLESS_CPU_BACKEND", True, "the backend of the job's groups for CPU tensors: every rank of a "
               "group uses one", lambda e, _r: e.cpu_backend),
    EnvSetting("CKPTLESS_CUDA_BACKEND", True, "the backend of the job's groups for CUDA tensors, compared as set "
               "(unset: each node's own default, nccl or none by its GPUs): set it on every node or on none",
               lambda e, _r: e.cuda_backend),
    EnvSetting("CKPTLESS_MIRROR_BUFFERS", True, "1 makes a rank mirror its replicated state too (as "
               "--mirror-replicated): a holder and its owner must agree on the contents", _mirror_buffers),
    _env_node("CKPTLESS_RECOVERY_TIMEOUT", "how long this node's ranks wait for the next generation"),
    _env_node("CKPTLESS_CAPTURE_ORDER", "where this node's processes wait for their own captures: no other rank "
              "sees it"),
    _env_node("TORCH_NCCL_ASYNC_ERROR_HANDLING", "checked in every process (0 or 2)"),
    _env_node("CKPTLESS_LOG_LEVEL", "this node's logs"),
    _env_node("CKPTLESS_HEARTBEAT_FILE", "set by the agent for each of its workers"),
    _env_node("CKPTLESS_EXIT_FILE", "set by the agent for each of its workers"),
    _env_node("CKPTLESS_DIGEST_DIR", "the chaos runner's and the tests' (each process writes its own digests)"),
    _env_node("CKPTLESS_CHAOS_DIR", "the chaos runner's and the tests' fault points"),
    _env_node("CKPTLESS_CHAOS_POINTS", "the chaos runner's and the tests' fault points"),
    _env_node("CKPTLESS_LOCAL_ADDR", "this node's own address"),
    _env_node("GLOO_SOCKET_IFNAME", "this node's own interface"),
    _env_node("NCCL_SOCKET_IFNAME", "this node's own interface"),
    _env_node("CKPTLESS_MIRROR_MIN_GBPS", "this agent's own warning"),
    _env_node("CKPTLESS_ETCD_BINARY", "the embedded etcd of a one-node job"),
    _env_node("CKPTLESS_PRELOAD", "this node's fork server"),
    _env_node("CKPTLESS_UNPORTED_WARN_S", "this agent's own warning"),
    _env_node("CKPTLESS_NODE_GPUS", "this node's GPUs"),
    _env_node("CKPTLESS_ETCD_USER", "this node's credentials for the one etcd"),
    _env_node("CKPTLESS_ETCD_PASSWORD", "this node's credentials for the one etcd"),
    _env_node("CKPTLESS_ETCD_CA_CERT", "this node's credentials for the one etcd"),
    _env_node("CKPTLESS_ETCD_CERT_KEY", "this node's credentials for the one etcd"),
    _env_node("CKPTLESS_ETCD_CERT", "this node's credentials for the one etcd"),
)


def job_config(cfg: LaunchConfig, environ: Mapping[str, str]) -> dict[str, Any]:
    """This agent's job-wide settings, by the names a refusal gives them, as JSON values: its flags and
    its environment (``environ``: what its workers inherit, ``environment.environ()``)."""
    env = ProcessEnv.from_mapping(environ)
    out = {s.label: (s.value(cfg) if s.value is not None else getattr(cfg, s.fields[0]))
           for s in SETTINGS if s.agree}
    out.update({s.label: s.value(env, environ) for s in ENV_SETTINGS if s.agree and s.value is not None})
    return out


# --- an agent after the job's end, or beside a live round ----------------------------------------------------
Admission = Literal["join", "mismatch", "ended", "other_run", "relaunch"]
#: Seconds past the last call that a relaunch of a failed job waits for its other agents. A relaunch's
#: agents start together (one command on every node); an agent that waits longer is far more likely a
#: scheduler's replacement for a node of the ended run, with the run's own command, that would otherwise
#: wait out join_timeout (900 s) for nodes that never come (issue 35). ``--rdzv-conf restart_timeout=S``.
RESTART_GRACE_S = 10.0


@dataclass(frozen=True)
class Records:
    """What etcd holds about a job id when an agent arrives, read before it writes anything."""

    state: RoundState | None  # the rendezvous round (its settings, who opened it, its participants)
    run_round: int | None  # the round the last run started from (None: none, or a run without recovery)
    status: JobStatus | None  # the last run's end; cleared only by a new run's generation 0
    live_ids: frozenset[str]  # nodes whose agents hold a lease now

    @property
    def live(self) -> bool:
        """An agent of the round is alive (its run goes on, forms, or is still leaving)."""
        return self.state is not None and bool(set(self.state.ids()) & self.live_ids)


def decide_admission(rec: Records, mine: Mapping[str, Any], *, identity: bool, restartable: bool) -> Admission:
    """What an agent with job-wide settings ``mine`` does on arrival.

    * ``mismatch``: a live round holds other settings (a running job, one forming, or an ended run's
      agents still leaving): refused before it writes a key or campaigns for leader.
    * ``join``: no run has ended (or the id is no identity, ``identity`` False: ``--rdzv-id none`` on
      an external etcd, shared by unrelated jobs), or a relaunch of the ended run has started: the
      rendezvous as usual.
    * ``ended``: the run is over and this agent has its settings (a late agent, a scheduler's
      replacement): one line, the run's outcome as the exit code. A succeeded run is always over,
      whatever the flags: nothing trains it again (a new --rdzv-id does, docs/launcher.md).
    * ``other_run``: the run is over and this agent's settings are not the run's: another job reusing
      the id (or the script was edited), refused rather than told "succeeded" without training.
    * ``relaunch``: the run failed, every agent of it is gone, and this agent can start it again (its
      snapshots, or ``--fresh-start``: ``restartable``), or one such relaunch is forming: a rendezvous
      bounded by :data:`RESTART_GRACE_S` (a relaunch may change settings: the failure may be why).
    """
    live, st = rec.live, rec.state
    differ = st is not None and bool(config_disagreement(st.config, mine))
    if rec.status is None or not identity:
        return "mismatch" if live and differ else "join"
    failed = rec.status.state == "failed"
    if failed and live and st is not None and st.state == "joining":  # a relaunch forming (the old run not cleared)
        return "mismatch" if differ else "relaunch"
    if live and st is not None and st.state == "closed" and rec.run_round is not None and st.round != rec.run_round:
        return "mismatch" if differ else "join"  # a relaunch started from a newer round: late to it
    # The run is over: every agent of it gone, or still leaving.
    if failed and restartable and not live:
        return "relaunch"
    return "other_run" if differ else "ended"


def can_restart(cfg: LaunchConfig) -> bool:
    """A relaunch of a job that failed: a node with ranks of its own (a spare-only node starts nothing)
    started with ``--fresh-start``, or with a ``--snapshot-dir`` that holds a complete snapshot of it."""
    if cfg.nproc_per_node < 1:
        return False
    if cfg.fresh_start:
        return True
    if not cfg.snapshot_dir:
        return False
    from ckptless.snapshot import stored_snapshots

    return bool(stored_snapshots(cfg.snapshot_dir, cfg.run_id))


def restart_window(cfg: LaunchConfig) -> float:
    """How long a relaunch of a failed job waits for its other agents (:data:`RESTART_GRACE_S`)."""
    last_call = float(cfg.rdzv_configs.get("last_call_timeout", 1.0))
    return float(cfg.rdzv_configs.get("restart_timeout", last_call + RESTART_GRACE_S))


def _outcome(status: JobStatus) -> str:
    return f"{status.state}: {' '.join(status.reason.split())}"


def ended_message(job_id: str, status: JobStatus, restartable: bool, waited: tuple[float, str] | None = None) -> str:
    """One line: the job is over, how it ended, and what this agent does about it. ``waited``: the relaunch
    window this agent waited out, and what came of it."""
    reason = " ".join(status.reason.split())
    code = 0 if status.state == "succeeded" else 1
    line = (f"job {job_id!r} has already ended: it {status.state} ({reason}); there is nothing to join, "
            f"so this agent exits {code}")
    if waited is not None:
        window, seen = waited
        return (f"{line}: no relaunch of it formed within {window:g}s ({seen}); to relaunch it, start all its "
                f"agents within {window:g}s of each other (--rdzv-conf restart_timeout=S), or use a new --rdzv-id")
    if status.state == "succeeded":
        return f"{line} (to train again, use a new --rdzv-id)"
    if restartable:
        return line
    return f"{line} (to run it again: a new --rdzv-id, or --snapshot-dir with its snapshots to resume from them)"


@dataclass(frozen=True)
class Relaunch:
    """An agent that relaunches a failed job (or joins its relaunch): its rendezvous is bounded."""

    status: JobStatus
    window_s: float
    line: str  # printed when it starts

    def gave_up(self, job_id: str, seen: str) -> JobAlreadyEnded:
        return JobAlreadyEnded(ended_message(job_id, self.status, True, (self.window_s, seen)), succeeded=False)


def read_records(client: EtcdClient, ks: Keyspace) -> Records:
    kv, rdzv, rnd = client.get(ks.status), client.get(ks.rdzv_state), client.get(ks.round)
    live = frozenset(k.key[len(ks.nodes_prefix):] for k in client.get_prefix(ks.nodes_prefix)[0])
    return Records(None if rdzv is None else RoundState.from_bytes(rdzv.value), None if rnd is None else int(rnd.value),
                   None if kv is None else JobStatus.from_json(kv.value), live)


def admit(client: EtcdClient, ks: Keyspace, cfg: LaunchConfig, environ: Mapping[str, str]) -> Relaunch | None:
    """Decide this agent's admission from the job's records (:func:`decide_admission`); reads, never writes.

    Raises :class:`ConfigMismatch` (a live round with other settings), :class:`JobAlreadyEnded` (the
    job is over: its outcome) or :class:`OtherRunSettings`; returns a :class:`Relaunch` when this agent
    relaunches a failed job, else None.
    """
    rec = read_records(client, ks)
    mine = job_config(cfg, environ)
    restartable = can_restart(cfg)
    decision = decide_admission(rec, mine, identity=cfg.run_id != "none", restartable=restartable)
    if decision == "mismatch":
        assert rec.state is not None
        rec.state.check(mine)
    if decision in ("join", "mismatch"):
        return None
    status = rec.status
    assert status is not None
    if decision == "ended":
        raise JobAlreadyEnded(ended_message(cfg.run_id, status, restartable), status.state == "succeeded")
    if decision == "other_run":
        assert rec.state is not None
        raise OtherRunSettings(cfg.run_id, _outcome(status), config_disagreement(rec.state.config, mine))
    window = restart_window(cfg)
    if rec.live:
        how = "joins its relaunch"
    elif cfg.fresh_start:
        how = "starts it again from step 0 (--fresh-start)"
    else:
        how = f"starts it again from its snapshots in {cfg.snapshot_dir}"
    line = (f"job {cfg.run_id!r} ended before ({_outcome(status)}); this agent {how}, if the relaunch's agents "
            f"({cfg.min_nodes} node(s) at least) come within {window:g}s; else it exits 1")
    return Relaunch(status, window, line)
