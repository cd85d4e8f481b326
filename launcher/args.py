"""Command line of ``ckptless-run``: torchrun's flags, plus ckptless's own.

Why a copy instead of importing ``torch.distributed.run``: that pulls in all of
torch (2+ s), and we need another default backend, our own flags and typed,
validated results.  A test walks torchrun's ``get_args_parser()`` and checks
every option string, dest, default, nargs and choices against ours.

Deliberate differences (docs/launcher.md):

* ``--rdzv-backend`` defaults to ``ckptless`` (etcd v3); ``etcd``/``etcd-v2``
  are accepted as aliases, ``c10d`` is rejected, ``static`` only on one node.
* ``--job-id`` is an alias of ``--rdzv-id``: the rendezvous id *is* the job's
  etcd key prefix, so two names for one value would only invite mismatches.
* No endpoint (or ``--standalone``) means an embedded etcd on this node.
"""

from __future__ import annotations

import argparse
import os
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from ckptless import environment
from ckptless.errors import ConfigError
from ckptless.launcher.arg_values import (DEFAULT_ETCD_PORT, Endpoint, Std, _check, _parse_signals,  # noqa: F401
                                          parse_endpoint, parse_nnodes, parse_rdzv_conf, parse_std, resolve_nproc)

DEFAULT_SHUTDOWN_TIMEOUT = 30.0
BACKEND_ALIASES = {"ckptless": "ckptless", "etcd": "ckptless", "etcd-v2": "ckptless", "static": "static"}
PLACEMENTS = ("ring", "group", "mixed")

DEFAULT_SHM_DIR = "/dev/shm/ckptless"


def default_shm_dir() -> str | None:
    """The node-local tier is on by default where /dev/shm is writable: a rank's own committed image
    then outlives its worker, so a second loss right after a recovery (before re-protection committed)
    is recovered from the node instead of ending a K = 1 job."""
    return DEFAULT_SHM_DIR if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


NUMA_MODES = ["node", "socket", "exclusive", "core-complex"]  # torch.numa.binding._AffinityMode values
@dataclass(frozen=True)
class LaunchConfig:
    """Everything ``ckptless-run`` was asked to do, resolved and validated."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    rdzv_backend: str  # normalised: "ckptless" or "static"
    rdzv_endpoint: Endpoint | None  # None: start an embedded etcd on this node
    run_id: str  # == job id == CKPTLESS_JOB_ID
    rdzv_configs: Mapping[str, str]
    standalone: bool
    node_rank: int
    master_addr: str
    master_port: int | None  # None: the store-hosting agent picks a free port
    local_addr: str | None
    max_restarts: int
    monitor_interval: float
    start_method: str
    event_log_handler: str
    role: str
    signals_to_handle: tuple[str, ...]
    shutdown_timeout: float
    virtual_local_rank: bool
    training_script: str
    training_script_args: tuple[str, ...]
    module: bool
    no_python: bool
    run_path: bool
    log_dir: str | None
    redirects: tuple[Std, ...]  # one entry per local rank
    tee: tuple[Std, ...]
    local_ranks_filter: frozenset[int] | None
    duplicate_stdout_filters: tuple[str, ...]
    duplicate_stderr_filters: tuple[str, ...]
    logs_specs: str | None
    numa_binding: str | None
    log_line_prefix_template: str = ""  # torchrun's since torch 2.14
    replicas: int = 1  # ckptless's own flags from here on
    mirror_every: int = 1
    placement: str = "ring"
    on_replica_mismatch: str = "stop"
    mirror_replicated: bool = False
    spares: int = 0
    snapshot_every: int = 0
    snapshot_dir: str | None = None
    fresh_start: bool = False
    goodput_dir: str | None = None
    hang_timeout: float | None = None
    lease_ttl: float = 2.0
    node_grace: float = 10.0
    replacement_timeout: float = 600.0
    lost_node: str = "wait"
    metrics_port: int | None = None
    shm_dir: str | None = None
    warm_respawn: bool = True
    spare_prebuild: bool = True
    spare_any_rank: bool = False
    spare_refill: bool = False
    nproc_per_node_spec: str = field(default="1", compare=False)

    @property
    def embedded_etcd(self) -> bool:
        """True when this node must start its own etcd (no endpoint given)."""
        return self.rdzv_endpoint is None


# Flags that parse but are not implemented: flag -> (field, default, why).  Remove
# entries as features land; parse_args() refuses a listed flag set away from its
# default so nobody believes a feature is on when it is not.
UNIMPLEMENTED: dict[str, tuple[str, object, str]] = {
    "--numa-binding": ("numa_binding", None, "NUMA binding is not supported by ckptless-run"),
    "--logs-specs": ("logs_specs", None, "custom LogsSpecs plugins are not supported by ckptless-run"),
    "--event-log-handler": ("event_log_handler", "null", "ckptless records events in its goodput ledger"),
    "--duplicate-stdout-filters": ("duplicate_stdout_filters", (), "log duplication is not supported"),
    "--duplicate-stderr-filters": ("duplicate_stderr_filters", (), "log duplication is not supported"),
    "--log-line-prefix-template": ("log_line_prefix_template", "", "a custom console line prefix is not supported "
                                   "by ckptless-run (tee'd lines are prefixed '[<role><local_rank>]:')"),
}


def unimplemented_flags(cfg: LaunchConfig) -> list[str]:
    """Flags in ``UNIMPLEMENTED`` whose value in ``cfg`` differs from the default."""
    return [flag for flag, (name, default, _) in UNIMPLEMENTED.items() if getattr(cfg, name) != default]


def check_implemented(cfg: LaunchConfig) -> None:
    """Raise ConfigError naming the first unimplemented flag that was set."""
    for flag in unimplemented_flags(cfg):
        name, _, why = UNIMPLEMENTED[flag]
        raise ConfigError(name, getattr(cfg, name), f"{flag}: {why}")


# --- argparse actions with torchrun's PET_* fallbacks ---------------------------
def _is_seconds(raw: str) -> bool:
    try:
        return float(raw) >= 0
    except ValueError:
        return False


def _env_actions(environ: Mapping[str, str]) -> tuple[type[argparse.Action], type[argparse.Action]]:
    """Actions with the semantics of torch.distributed.argparse_util.env/check_env.

    They read ``PET_<DEST>`` from ``environ`` (not always the process's own
    environment) so tests and the agent can parse against an explicit one.
    """

    class env(argparse.Action):
        def __init__(self, option_strings: Sequence[str], dest: str, default: Any = None, required: bool = False,
                     **kwargs: Any) -> None:
            default = environ.get(f"PET_{dest.upper()}", default)
            if default:
                required = False
            super().__init__(option_strings, dest, default=default, required=required, **kwargs)

        def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
            setattr(namespace, self.dest, values)

    class check_env(argparse.Action):
        def __init__(self, option_strings: Sequence[str], dest: str, default: bool = False, **kwargs: Any) -> None:
            name = f"PET_{dest.upper()}"
            raw = environ.get(name, "1" if default else "0")
            try:
                value = bool(int(raw))
            except ValueError as exc:
                raise ConfigError(name, raw, "must be an integer (0 = off, other = on)") from exc
            super().__init__(option_strings, dest, const=True, default=value, nargs=0, **kwargs)

        def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
            setattr(namespace, self.dest, self.const)

    return env, check_env


def _completion_shells() -> Any:
    """torchrun's ``--print-completion`` choices (torch 2.14): shtab's shells, or its fallback list."""
    try:
        import shtab
    except ImportError:
        return ["bash", "zsh", "tcsh"]
    return shtab.SUPPORTED_SHELLS


class _PrintCompletion(argparse.Action):
    """torchrun's ``--print-completion SHELL`` (torch 2.14): this command's completion script, from the
    optional ``shtab`` package, then exit."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        try:
            import shtab
        except ImportError:
            parser.exit(1, f"{option_string} requires the 'shtab' package: pip install shtab\n")
        print(shtab.complete(parser, shell=values))
        parser.exit()


def _comma_separated_list(value: str) -> list[str]:
    """torchrun's list syntax: ``a,b``; a doubled comma escapes a literal comma."""
    placeholder = "<COMMA_PLACEHOLDER>"
    return [item.replace(placeholder, ",") for item in value.replace(",,", placeholder).split(",")]


def _opt(name: str) -> list[str]:
    """``--foo-bar`` plus torchrun's underscore spelling ``--foo_bar``."""
    tail = name[2:]
    return [name, "--" + tail.replace("-", "_")] if "-" in tail else [name]


def build_parser(environ: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    """The ``ckptless-run`` parser; ``environ`` (default: this process's, see
    :func:`ckptless.environment.environ`) feeds PET_* fallbacks."""
    env, check_env = _env_actions(environment.environ() if environ is None else environ)
    p = _Parser(
        prog="ckptless-run",
        description="Checkpointless launcher: torchrun's flags plus peer-mirrored in-memory recovery.",
    )
    add: Callable[..., argparse.Action] = p.add_argument
    # torchrun: sizes
    add("--nnodes", action=env, type=str, default="1:1", help="Number of nodes, or MIN:MAX.")
    add(*_opt("--nproc-per-node"), action=env, type=str, default="1",
        help="Workers per node: an int, or cpu, gpu, xpu, auto.")
    # torchrun: rendezvous
    add(*_opt("--rdzv-backend"), action=env, type=str, default="ckptless",
        help="ckptless (etcd v3; 'etcd'/'etcd-v2' are aliases) or static (single node only).")
    add(*_opt("--rdzv-endpoint"), action=env, type=str, default="",
        help=f"etcd endpoint HOST[:PORT] (port {DEFAULT_ETCD_PORT}); empty: embedded etcd.")
    add(*_opt("--rdzv-id"), *_opt("--job-id"), dest="rdzv_id", action=env, type=str, default="none",
        help="Job id (etcd key prefix); --job-id is an alias.")
    add(*_opt("--rdzv-conf"), action=env, type=str, default="", help="Extra rendezvous config k=v,k2=v2.")
    add("--standalone", action=check_env, help="Single node with an embedded etcd and a random job id.")
    # torchrun: worker lifecycle
    add(*_opt("--max-restarts"), action=env, type=int, default=0, help="Max worker group restarts.")
    add(*_opt("--monitor-interval"), action=env, type=float, default=0.1,
        help="Seconds between agent health checks (worker exits are reported at once regardless).")
    add(*_opt("--start-method"), action=env, type=str, default="spawn",
        choices=["spawn", "fork", "forkserver"], help="Accepted for compatibility; workers are always exec'd.")
    add(*_opt("--event-log-handler"), action=env, type=str, default="null", help="Only 'null' is supported.")
    add("--role", action=env, type=str, default="default", help="Role name of the workers.")
    add("-m", "--module", action=check_env, help="Run the script as 'python -m module'.")
    add(*_opt("--no-python"), action=check_env, help="Execute the script directly, without python.")
    add(*_opt("--run-path"), action=check_env, help="Run the script with runpy.run_path (absolute path).")
    add(*_opt("--log-dir"), action=env, type=str, default=None, help="Base directory for worker logs.")
    add("-r", "--redirects", action=env, type=str, default="0",
        help="Redirect streams to files: 0-3, or per local rank 0:3,1:1 (1=out, 2=err, 3=both).")
    add("-t", "--tee", action=env, type=str, default="0", help="Like --redirects, but also to console.")
    add(*_opt("--local-ranks-filter"), action=env, type=str, default="",
        help="Only show these local ranks' output on the console, e.g. 0,1.")
    add(*_opt("--log-line-prefix-template"), action=env, type=str, default="",
        help="Unsupported (torchrun's since torch 2.14): tee'd lines are prefixed '[<role><local_rank>]:'.")
    for stream in ("stdout", "stderr"):
        add(*_opt(f"--duplicate-{stream}-filters"), action=env, type=_comma_separated_list, default=[],
            help="Unsupported (accepted for compatibility).")
    add(*_opt("--node-rank"), type=int, action=env, default=0, help="Node rank (static backend only).")
    add(*_opt("--master-addr"), default="127.0.0.1", type=str, action=env, help="Store address (static only).")
    add(*_opt("--master-port"), default=None, type=int, action=env,
        help="Store port (static backend); default: a free port.")
    add(*_opt("--local-addr"), default=None, type=str, action=env, help="Address other nodes reach this one at.")
    add(*_opt("--logs-specs"), default=None, type=str, help="Unsupported (accepted for compatibility).")
    add(*_opt("--numa-binding"), type=str, choices=NUMA_MODES, default=None, help="Unsupported.")
    add(*_opt("--signals-to-handle"), action=env, type=str, default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        help="Signals the agent forwards to workers.")
    add(*_opt("--shutdown-timeout"), action=env, type=int, default=None,
        help="Seconds between SIGTERM and SIGKILL at shutdown (TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30).")
    add(*_opt("--virtual-local-rank"), action=check_env,
        help="LOCAL_RANK=0 for all workers; CUDA_VISIBLE_DEVICES picks each one's GPU.")
    add(*_opt("--print-completion"), action=_PrintCompletion, choices=_completion_shells(),
        help="Print a shell completion script for ckptless-run and exit (needs the optional 'shtab' package).")
    # ckptless
    add("--replicas", action=env, type=int, default=1, help="K: peers holding a mirror of each shard.")
    add("--mirror-every", action=env, type=int, default=1, help="Mirror every N steps.")
    add("--placement", action=env, type=str, default="ring", choices=list(PLACEMENTS), help="Mirror placement.")
    add("--on-replica-mismatch", action=env, type=str, default="stop", choices=["stop", "replace"],
        help="Data-parallel replicas whose state differs at a mirror round (silent data corruption): stop the "
             "job with one error naming ranks, tensors and step, or replace the odd rank of a majority.")
    add("--mirror-replicated", action=check_env,
        help="Mirror data-parallel replicated state too (DDP parameters, HSDP shards), not only what no replica "
             "holds: survives the loss of every replica of a shard at once, for K x S bytes per round.")
    add("--spares", action=env, type=int, default=0, help="Hot spare workers per node.")
    add("--snapshot-every", action=env, type=int, default=0, help="Disk snapshot every M steps (0: off).")
    add("--snapshot-dir", action=env, type=str, default=None, help="Directory for disk snapshots.")
    add("--fresh-start", action=check_env, help="Start from step 0 although --snapshot-dir holds this job's "
        "snapshots (e.g. of another world size): they are set aside, unchanged, in <dir>/<id>.set-aside-<time>.")
    add("--goodput-dir", action=env, type=str, default=None, help="Directory for the goodput ledger.")
    add("--hang-timeout", action=env, type=float, default=None,
        help="SIGKILL a worker whose progress stalls this many seconds.")
    add("--lease-ttl", action=env, type=float, default=2.0, help="etcd lease TTL in seconds (liveness).")
    add("--node-grace", action=env, type=float, default=10.0,
        help="Seconds a node may lose its lease (a paused or partitioned agent) before its ranks are re-planned.")
    add("--replacement-timeout", action=env, type=float, default=600.0,
        help="Seconds the job holds, survivors paused with their state and mirrors, when a lost rank has no "
             "live spare and no node to respawn on, waiting for one: a spare, or a new agent started with the "
             "same --rdzv-id (a scheduler's replacement node, admitted as spares). Then it ends, naming the "
             "ranks (default 600).")
    add("--lost-node", action=env, type=str, default="wait", choices=("wait", "shrink"),
        help="When a lost rank has no spare and no node to respawn on: 'wait' for one (--replacement-timeout), "
             "or 'shrink': go on at once with fewer processes, each survivor also running a lost rank's "
             "micro-batch of every step (same global batch; DDP jobs; needs --nnodes MIN:MAX with MIN below "
             "MAX, and keeps at least MIN nodes). Default: wait.")
    add("--metrics-port", action=env, type=int, default=None,
        help="Serve Prometheus metrics on this port (0: any free port; default: off).")
    add("--shm-dir", action=env, type=str, default=None,
        help="Keep peer replicas and each rank's own committed image in files here: they survive a worker's "
             f"death, and a rank respawned on this node restores its own image from them (default: {DEFAULT_SHM_DIR} "
             "where /dev/shm is writable; a full dir degrades to memory with one warning).")
    add("--no-shm-dir", dest="shm_off", action="store_true",
        help="Keep replicas and own images in the workers' memory only (they die with the worker).")
    add("--no-warm-respawn", dest="warm_respawn", action="store_false",
        help="Respawn failed workers cold (a fresh python) instead of from this agent's warm fork server.")
    add("--no-spare-prebuild", dest="spare_prebuild", action="store_false",
        help="Spares wait in ckptless.init() and build the script's objects only once assigned a rank "
             "(default: each spare builds them as a standby rank while it waits).")
    add("--spare-refill", action=check_env,
        help="Keep this node's --spares N: once a spare took a rank and that recovery is over (every rank here "
             "trains again), start a new one, so later failures also find a warm spare.")
    add("--spare-any-rank", action=check_env,
        help="The default with pre-built spares (kept for compatibility): a pre-built spare may take any lost rank "
             "whose image has its standby rank's layout in place, without re-running the setup, when its setup "
             "read no rank (RANK/LOCAL_RANK, dist.get_rank(), job.rank) and made no group; otherwise it restarts "
             "as that rank.")
    add("--no-spare-any-rank", dest="spare_rank_bound", action="store_true",
        help="Pre-built spares take only their standby rank in place and restart as any other rank.")
    # positional
    add("training_script", type=str, help="Training script (or module with -m), then its arguments.")
    add("training_script_args", nargs=argparse.REMAINDER)
    return p


def _standalone_id(ns: argparse.Namespace) -> str:
    """A single-node job's id: random, except with --snapshot-dir, where a stable id (from the
    snapshot dir, the script and its arguments) lets the same command resume from its snapshots."""
    if not ns.snapshot_dir:
        return str(uuid.uuid4())
    import hashlib

    key = "\0".join([os.path.abspath(ns.snapshot_dir), os.path.abspath(ns.training_script),
                     *ns.training_script_args])
    return "standalone-" + hashlib.sha256(key.encode()).hexdigest()[:16]


class _Parser(argparse.ArgumentParser):
    """Usage errors as ONE line (no usage dump, no traceback), exit status 2."""

    def error(self, message: str) -> Any:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def config_from_namespace(ns: argparse.Namespace, environ: Mapping[str, str] | None = None) -> LaunchConfig:
    """Validate and resolve parsed flags into a LaunchConfig (raises ConfigError)."""
    environ = environment.environ() if environ is None else environ
    min_nodes, max_nodes = parse_nnodes(ns.nnodes)
    backend_in = ns.rdzv_backend
    _check(backend_in in BACKEND_ALIASES, "rdzv_backend", backend_in,
           "ckptless-run coordinates through etcd: use ckptless (or etcd/etcd-v2), or static on one node;"
           " c10d and others are not supported")
    backend = BACKEND_ALIASES[backend_in]
    run_id = ns.rdzv_id
    endpoint: Endpoint | None = None
    if ns.standalone:
        _check(max_nodes == 1, "nnodes", ns.nnodes, "--standalone runs exactly one node")
        backend, run_id = "ckptless", _standalone_id(ns)
    elif backend == "static":
        _check(max_nodes == 1, "rdzv_backend", backend_in,
               "static rendezvous is only supported on one node; multi-node needs an etcd --rdzv-endpoint")
        backend, run_id = "ckptless", (str(uuid.uuid4()) if run_id == "none" else run_id)
    elif ns.rdzv_endpoint:
        endpoint = parse_endpoint(ns.rdzv_endpoint)
    else:
        _check(max_nodes == 1, "rdzv_endpoint", ns.rdzv_endpoint,
               "a multi-node job needs --rdzv-endpoint=HOST[:PORT] of an etcd server")
        if run_id == "none":  # like torchrun's implicit single-node c10d: a fresh id
            run_id = _standalone_id(ns)
    _check(ns.max_restarts >= 0, "max_restarts", ns.max_restarts, "must be >= 0")
    _check(ns.monitor_interval > 0, "monitor_interval", ns.monitor_interval, "must be > 0")
    _check(ns.node_rank >= 0, "node_rank", ns.node_rank, "must be >= 0")
    _check(ns.master_port is None or 0 <= ns.master_port < 65536, "master_port", ns.master_port,
           "must be in 0..65535")
    nproc = resolve_nproc(ns.nproc_per_node)
    ranks_filter: frozenset[int] | None = None
    if ns.local_ranks_filter:
        try:
            ranks_filter = frozenset(int(r) for r in ns.local_ranks_filter.split(","))
        except ValueError as exc:
            raise ConfigError("local_ranks_filter", ns.local_ranks_filter,
                              "must be comma-separated integers, e.g. 0,1,2") from exc
    if ns.shutdown_timeout is not None:
        shutdown = float(ns.shutdown_timeout)
    else:
        raw = environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "")
        try:
            shutdown = float(raw) if raw else DEFAULT_SHUTDOWN_TIMEOUT
        except ValueError as exc:
            raise ConfigError("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", raw, "must be a number") from exc
    _check(shutdown >= 0, "shutdown_timeout", shutdown, "must be >= 0")
    _check(not (ns.no_python and ns.module), "module", True, "--no-python and --module are exclusive")
    _check(not ns.run_path or os.path.isabs(ns.training_script), "training_script", ns.training_script,
           "--run-path needs an absolute path")
    _check(ns.replicas >= 0, "replicas", ns.replicas, "must be >= 0")
    _check(ns.mirror_every >= 1, "mirror_every", ns.mirror_every, "must be >= 1")
    _check(ns.spares >= 0, "spares", ns.spares, "must be >= 0")
    _check(nproc >= 1 or ns.spares >= 1, "nproc_per_node", ns.nproc_per_node,
           "must be >= 1 (0 only for a spare-only node, with --spares N)")
    _check(not ns.spare_refill or ns.spares >= 1, "spare_refill", True, "needs --spares N (N >= 1) to keep")
    _check(not ns.spare_any_rank or (ns.spares >= 1 and ns.spare_prebuild), "spare_any_rank", True,
           "needs pre-built spares: --spares N (N >= 1), without --no-spare-prebuild")
    _check(not (ns.spare_any_rank and ns.spare_rank_bound), "spare_any_rank", True,
           "--spare-any-rank and --no-spare-any-rank contradict each other")
    _check(not (ns.shm_off and ns.shm_dir), "shm_dir", ns.shm_dir, "--shm-dir and --no-shm-dir contradict each other")
    shm_dir = ns.shm_dir if ns.shm_dir else (None if ns.shm_off else default_shm_dir())
    # Any-rank adoption is the default for pre-built spares: a spare helps whichever rank is lost, and
    # it is safe, since a spare whose setup read its rank restarts as the lost rank instead. The policy is
    # kept without --spares too: an agent that arrives after the job formed serves as spares (issue 35:
    # --no-spare-any-rank was then ignored).
    any_rank = ns.spare_prebuild and not ns.spare_rank_bound
    _check(ns.snapshot_every >= 0, "snapshot_every", ns.snapshot_every, "must be >= 0 (0 = off)")
    _check(ns.snapshot_every == 0 or bool(ns.snapshot_dir), "snapshot_dir", ns.snapshot_dir,
           "--snapshot-every needs --snapshot-dir")
    _check(not ns.fresh_start or bool(ns.snapshot_dir), "fresh_start", True,
           "--fresh-start sets a job's snapshots aside: it needs the --snapshot-dir that holds them")
    _check(ns.hang_timeout is None or ns.hang_timeout > 0, "hang_timeout", ns.hang_timeout, "must be > 0")
    _check(ns.lease_ttl > 0, "lease_ttl", ns.lease_ttl, "must be > 0")
    _check(ns.node_grace > 0, "node_grace", ns.node_grace, "must be > 0")
    _check(ns.replacement_timeout > 0, "replacement_timeout", ns.replacement_timeout, "must be > 0 seconds")
    last_call = parse_rdzv_conf(ns.rdzv_conf).get("last_call_timeout", "1")
    _check(_is_seconds(last_call), "rdzv_conf", ns.rdzv_conf, "last_call_timeout must be a number of seconds >= 0")
    restart = parse_rdzv_conf(ns.rdzv_conf).get("restart_timeout", "0")
    _check(_is_seconds(restart), "rdzv_conf", ns.rdzv_conf, "restart_timeout must be a number of seconds >= 0")
    _check(ns.lost_node in ("wait", "shrink"), "lost_node", ns.lost_node, "must be 'wait' or 'shrink' (PET_LOST_NODE)")
    _check(ns.lost_node != "shrink" or min_nodes < max_nodes, "lost_node", ns.lost_node,
           f"going on with fewer nodes needs --nnodes MIN:MAX with MIN < MAX (got {ns.nnodes}): MIN is the "
           "fewest nodes the job may run on")
    _check(ns.metrics_port is None or 0 <= ns.metrics_port < 65536, "metrics_port", ns.metrics_port,
           "must be a port number (0: any free port)")
    embedded = endpoint is None
    _check(not (nproc == 0 and (embedded or ns.standalone)), "nproc_per_node", ns.nproc_per_node,
           "a spare-only node (--nproc-per-node 0) joins an existing job: give that job's --rdzv-endpoint and "
           "--rdzv-id (with --standalone it would start a private etcd that no job can reach)")
    if min_nodes == max_nodes and nproc >= 1:
        world = min_nodes * nproc
        _check(world < 2 or ns.replicas < world, "replicas", ns.replicas,
               f"must be < the world size ({world}): each rank's K mirrors live on other ranks")
    values: dict[str, Any] = {f.name: getattr(ns, f.name) for f in fields(LaunchConfig) if hasattr(ns, f.name)}
    values.update(
        min_nodes=min_nodes, max_nodes=max_nodes, nproc_per_node=nproc, nproc_per_node_spec=ns.nproc_per_node,
        rdzv_backend=backend, rdzv_endpoint=endpoint, run_id=run_id, rdzv_configs=parse_rdzv_conf(ns.rdzv_conf),
        signals_to_handle=_parse_signals(ns.signals_to_handle), shutdown_timeout=shutdown,
        training_script_args=tuple(ns.training_script_args), local_ranks_filter=ranks_filter, spare_any_rank=any_rank,
        shm_dir=shm_dir,
        redirects=parse_std(ns.redirects, nproc, "redirects"), tee=parse_std(ns.tee, nproc, "tee"),
        duplicate_stdout_filters=tuple(ns.duplicate_stdout_filters),
        duplicate_stderr_filters=tuple(ns.duplicate_stderr_filters),
    )
    return LaunchConfig(**values)


def parse_args(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None,
               *, allow_unimplemented: bool = False) -> LaunchConfig:
    """Parse ``argv`` (default sys.argv[1:]) into a LaunchConfig.

    Usage errors (unknown flag, bad choice) exit via argparse with one line on
    stderr; semantic errors raise ConfigError; unimplemented flags set away
    from their defaults raise ConfigError unless ``allow_unimplemented``.
    """
    ns = build_parser(environ).parse_args(None if argv is None else list(argv))
    cfg = config_from_namespace(ns, environ)
    if not allow_unimplemented:
        check_implemented(cfg)
    return cfg
