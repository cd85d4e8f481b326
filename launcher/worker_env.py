"""Environment and command line of one worker, computed exactly like torchrun.

Why pure functions: the environment is the whole contract between the agent
and user code (``init_process_group("env://")``, ``LOCAL_RANK`` for the device,
ckptless's own ``CKPTLESS_*`` settings).  Keeping it free of I/O lets tests
compare it variable by variable with what real ``torchrun`` gives a worker
(tests/e2e/test_worker_env.py) and lets the agent compute the environment of a
replacement before it spawns it.

Sources mirrored (torch 2.13): ``LocalElasticAgent._start_workers`` and
``_set_local_rank_env``, ``DefaultLogsSpecs.reify`` (TORCHELASTIC_ERROR_FILE),
``torch.distributed.run.config_from_args`` (OMP_NUM_THREADS, the command line)
and ``launcher.api.launch_agent`` (TORCHELASTIC_SIGNALS_TO_HANDLE).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from string import Template
from typing import TYPE_CHECKING

from ckptless.errors import ConfigError
from ckptless.launcher.devices import device_env
from ckptless.worker import nccl_env

if TYPE_CHECKING:  # only for a type annotation; args.py has no side effects anyway
    from ckptless.launcher.args import LaunchConfig

CKPTLESS_PREFIX = "CKPTLESS_"
LOCAL_RANK_MACRO = "${local_rank}"
# runpy.run_path in a fresh interpreter, with sys.argv = [script, *args] like torchrun's run_script_path.
RUN_PATH_CODE = "import runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"

# Variables torchrun itself gives every worker (beyond what the parent had).
TORCHRUN_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCHELASTIC_ERROR_FILE",
    "TORCHELASTIC_SIGNALS_TO_HANDLE",
)


@dataclass(frozen=True)
class WorkerLayout:
    """Where this node's workers sit in the job; one per (generation, node).

    ``rank_offset`` and ``world_size`` are explicit (not node_rank * nproc)
    because nodes may run different numbers of workers, and because after a
    recovery the rank numbers are assigned by the coordinator, not by order.
    """

    node_rank: int  # GROUP_RANK
    nnodes: int  # GROUP_WORLD_SIZE
    nproc_per_node: int  # LOCAL_WORLD_SIZE
    rank_offset: int  # global rank of local rank 0
    world_size: int  # WORLD_SIZE
    master_addr: str  # host of the TCPStore the agents host
    master_port: int
    run_id: str
    restart_count: int = 0
    max_restarts: int = 0
    role: str = "default"
    role_rank_offset: int | None = None  # default: rank_offset (one role)
    role_world_size: int | None = None  # default: world_size
    use_agent_store: bool = True  # workers connect to the agent's store, never host one
    virtual_local_rank: bool = False
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1 or self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError("layout", (self.node_rank, self.nnodes, self.nproc_per_node),
                              "need nproc >= 1 and 0 <= node_rank < nnodes")
        if self.rank_offset < 0 or self.rank_offset + self.nproc_per_node > self.world_size:
            raise ConfigError("rank_offset", self.rank_offset,
                              f"ranks {self.rank_offset}..{self.rank_offset + self.nproc_per_node - 1} "
                              f"do not fit in world_size {self.world_size}")

    @classmethod
    def uniform(cls, node_rank: int, nnodes: int, nproc: int, master_addr: str, master_port: int,
                run_id: str, **kw: object) -> WorkerLayout:
        """The common layout: every node runs ``nproc`` workers, ranks in node order."""
        return cls(node_rank=node_rank, nnodes=nnodes, nproc_per_node=nproc, rank_offset=node_rank * nproc,
                   world_size=nnodes * nproc, master_addr=master_addr, master_port=master_port,
                   run_id=run_id, **kw)  # type: ignore[arg-type]


def nccl_settings(parent_env: Mapping[str, str]) -> dict[str, str]:
    """torch's NCCL settings for the workers (:mod:`ckptless.worker.nccl_env`): error mode 2 (abort the
    communicator, keep the process) where torchrun gives 1 (tear the process down), torch's dump-and-kill
    monitor off, the watchdog's post-error sleep short. Why: a survivor of a failure holds its peers'
    replicas, and a replacement must not be ended by a failure that came before it; ckptless aborts a
    broken generation itself (ckptless/worker/abort.py). The user's values are kept where set; one
    that lets torch end a survivor or a replacement is refused (ConfigError, exit 2 at launch)."""
    return nccl_env.for_workers(parent_env)


def torchrun_env(layout: WorkerLayout, local_rank: int, parent_env: Mapping[str, str],
                 error_file: str | None = None) -> dict[str, str]:
    """Only the variables torchrun adds for one worker (not the inherited ones).

    ``parent_env`` is the agent's environment: torchrun reads
    TORCH_NCCL_ASYNC_ERROR_HANDLING, OMP_NUM_THREADS and CUDA_VISIBLE_DEVICES
    from it.  ``error_file`` is the worker's error.json, or None when logs go
    to /dev/null (torchrun then sets the variable to "").
    """
    if not 0 <= local_rank < layout.nproc_per_node:
        raise ConfigError("local_rank", local_rank, f"must be in 0..{layout.nproc_per_node - 1}")
    rank = layout.rank_offset + local_rank
    role_offset = layout.rank_offset if layout.role_rank_offset is None else layout.role_rank_offset
    role_world = layout.world_size if layout.role_world_size is None else layout.role_world_size
    env = {
        "RANK": str(rank),
        "GROUP_RANK": str(layout.node_rank),
        "ROLE_RANK": str(role_offset + local_rank),
        "ROLE_NAME": layout.role,
        "LOCAL_WORLD_SIZE": str(layout.nproc_per_node),
        "WORLD_SIZE": str(layout.world_size),
        "GROUP_WORLD_SIZE": str(layout.nnodes),
        "ROLE_WORLD_SIZE": str(role_world),
        "MASTER_ADDR": layout.master_addr,
        "MASTER_PORT": str(layout.master_port),
        "TORCHELASTIC_RESTART_COUNT": str(layout.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(layout.max_restarts),
        "TORCHELASTIC_RUN_ID": layout.run_id,
        "TORCHELASTIC_USE_AGENT_STORE": str(layout.use_agent_store),  # "True"/"False", as torchrun
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": nccl_settings(parent_env)["TORCH_NCCL_ASYNC_ERROR_HANDLING"],
        "TORCHELASTIC_ERROR_FILE": error_file or "",
        # torchrun's launch_agent puts this in its own environment; workers inherit it.
        "TORCHELASTIC_SIGNALS_TO_HANDLE": layout.signals_to_handle,
    }
    env.update(_local_rank_env(layout, local_rank, parent_env))
    omp = omp_num_threads(layout.nproc_per_node, parent_env)
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    return env


def _local_rank_env(layout: WorkerLayout, local_rank: int, parent_env: Mapping[str, str]) -> dict[str, str]:
    """LOCAL_RANK and CUDA_VISIBLE_DEVICES, with torchrun's virtual-local-rank mode: a member's GPU is
    its local rank (the rule a spare's and a respawn's GPU follow too lives in launcher/devices.py)."""
    return device_env(local_rank, layout.virtual_local_rank, parent_env)


def omp_num_threads(nproc: int, parent_env: Mapping[str, str]) -> str | None:
    """torchrun's rule: keep the parent's OMP_NUM_THREADS; else "1" when nproc > 1.

    Why: N workers each starting one OpenMP thread per core oversubscribe the
    machine N-fold.  The caller logs torchrun's warning once when this
    returns "1" and the parent had no value (see ``omp_warning_needed``).
    """
    if "OMP_NUM_THREADS" in parent_env:
        return parent_env["OMP_NUM_THREADS"]
    return "1" if nproc > 1 else None


def omp_warning_needed(nproc: int, parent_env: Mapping[str, str]) -> bool:
    """True when torchrun would print its OMP_NUM_THREADS=1 warning."""
    return nproc > 1 and "OMP_NUM_THREADS" not in parent_env


def worker_env(layout: WorkerLayout, local_rank: int, parent_env: Mapping[str, str],
               ckptless_env: Mapping[str, str] | None = None, error_file: str | None = None) -> dict[str, str]:
    """The complete environment for one worker's ``Popen(env=...)``.

    Precedence as in torchrun (parent < torchrun's variables), then the
    caller's ``CKPTLESS_*`` variables on top.  Every key in ``ckptless_env``
    must carry the ``CKPTLESS_`` prefix so ours can never shadow torch's.
    """
    env = dict(parent_env)
    env.update(torchrun_env(layout, local_rank, parent_env, error_file))
    env.update(nccl_settings(parent_env))  # beyond torchrun's: torch's NCCL machinery must spare a recovery
    for key, value in (ckptless_env or {}).items():
        if not key.startswith(CKPTLESS_PREFIX):
            raise ConfigError("ckptless_env", key, f"must start with {CKPTLESS_PREFIX}")
        env[key] = str(value)
    return env


def ckptless_env_from_config(cfg: LaunchConfig, *, etcd_endpoint: str, node_id: str, generation: int,
                             recovery: bool = True, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The ``CKPTLESS_*`` variables derived from a LaunchConfig, for every worker of a node (the agent
    adds each worker's own: id, role, heartbeat and exit files). ``recovery=False`` (world size 1, or
    ``--replicas 0``): the workers mirror nothing."""
    env = {
        "CKPTLESS_ETCD_ENDPOINT": etcd_endpoint,
        "CKPTLESS_JOB_ID": cfg.run_id,
        "CKPTLESS_NODE_ID": node_id,
        "CKPTLESS_GENERATION": str(generation),
        "CKPTLESS_REPLICAS": str(cfg.replicas if recovery else 0),
        "CKPTLESS_MIRROR_EVERY": str(cfg.mirror_every),
        "CKPTLESS_PLACEMENT": cfg.placement,
        "CKPTLESS_ON_REPLICA_MISMATCH": cfg.on_replica_mismatch,
        "CKPTLESS_MIRROR_REPLICATED": "1" if cfg.mirror_replicated else "0",
        "CKPTLESS_LEASE_TTL": repr(float(cfg.lease_ttl)),
        "CKPTLESS_REPLACEMENT_TIMEOUT": repr(float(cfg.replacement_timeout)),
        "CKPTLESS_LOST_NODE": cfg.lost_node,
    }
    for key, path in (("CKPTLESS_GOODPUT_DIR", cfg.goodput_dir), ("CKPTLESS_SHM_DIR", cfg.shm_dir)):
        if path:
            env[key] = os.path.abspath(path)
    if cfg.local_addr:  # workers' Gloo binds here too (see worker/rebindable.new_gloo)
        env["CKPTLESS_LOCAL_ADDR"] = cfg.local_addr
    if cfg.snapshot_dir:  # also without --snapshot-every: a restarted job resumes from it
        env["CKPTLESS_SNAPSHOT_DIR"] = os.path.abspath(cfg.snapshot_dir)
        env["CKPTLESS_SNAPSHOT_EVERY"] = str(cfg.snapshot_every)
    if cfg.hang_timeout is not None:
        env["CKPTLESS_HANG_TIMEOUT"] = str(cfg.hang_timeout)
    env.update(extra or {})
    return env


def python_executable(parent_env: Mapping[str, str]) -> str:
    """The interpreter for workers: ``PYTHON_EXEC`` if set (as torchrun), else ours."""
    return parent_env.get("PYTHON_EXEC") or sys.executable


def build_command(training_script: str | LaunchConfig, script_args: Sequence[str] = (), *, module: bool = False,
                  no_python: bool = False, run_path: bool = False, python: str | None = None) -> list[str]:
    """argv for a worker, as torchrun builds it (before ``${local_rank}`` substitution).

    ``build_command(cfg)`` with a LaunchConfig takes script, args and mode
    from it (the other arguments are then ignored, except ``python``).

    * default: ``python -u script args`` (unbuffered, so logs interleave in order)
    * ``module``: ``python -u -m module args``
    * ``no_python``: ``script args`` (any executable)
    * ``run_path``: ``python -u -c <runpy.run_path> script args``; torchrun runs
      run_path in a multiprocessing child, we exec a fresh interpreter so the
      worker is a plain process we can reap and kill like the others.  It
      takes precedence over ``no_python``, as in torchrun.
    """
    if not isinstance(training_script, str):
        cfg = training_script
        return build_command(cfg.training_script, cfg.training_script_args, module=cfg.module,
                             no_python=cfg.no_python, run_path=cfg.run_path, python=python)
    exe = python or sys.executable
    if run_path:
        return [exe, "-u", "-c", RUN_PATH_CODE, training_script, *script_args]
    if no_python:
        if module:
            raise ConfigError("module", True, "--no-python and --module cannot be used together")
        return [training_script, *script_args]
    return [exe, "-u", *(["-m"] if module else []), training_script, *script_args]


def substitute_local_rank(argv: Sequence[str], local_rank: int) -> list[str]:
    """torchrun's macro: every ``${local_rank}`` in argv becomes the local rank.

    Uses ``string.Template.safe_substitute`` exactly as torchrun does (so ``$$``
    also collapses to ``$``: identical behaviour beats a "fix").
    """
    return [Template(arg).safe_substitute(local_rank=str(local_rank)) for arg in argv]


def command_from_config(cfg: LaunchConfig, parent_env: Mapping[str, str]) -> list[str]:
    """``build_command`` fed from a LaunchConfig, honouring ``PYTHON_EXEC`` in the agent's environment."""
    return build_command(cfg, python=python_executable(parent_env))
