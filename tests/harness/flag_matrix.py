"""The flag x fault matrix: every ``ckptless-run`` flag, the non-default value it is tried with
beside one SIGKILL, and the outcome it must give.

Why a table read against the launcher's own parser: a flag tested only alone once lost
every job on its first recovery (``--metrics-port``: a gauge with an unknown phase name
escaped the agent). ``tests/e2e/test_flag_fault_matrix.py`` fails when a flag of
``build_parser()`` has no row here, so a new flag cannot land without its fault case.

A row's ``job`` names the CI job that carries it: flags that can share a job run together
(one fault-free twin, one faulty run each), so the whole matrix fits CI's time; the slow
matrix runs every row alone. Placeholders in args: ``{out}`` the job's output directory,
``{shm}`` a fresh /dev/shm directory, ``{port}`` a free TCP port, ``{train}`` the reference
script's absolute path.
"""

from __future__ import annotations

from dataclasses import dataclass

# Outcomes
BITWISE = "bitwise"    # the faulty run ends bitwise equal to the fault-free twin, every agent exits 0
ENDS = "ends"          # recovery is off by this flag: the kill ends the job at once, exit non-zero, nothing left
REFUSED = "refused"    # accepted by the parser for torchrun compatibility, refused at start with one clear line
BASE = "base"          # given to every job of the matrix (the job cannot run without it)
PRINTS = "prints"      # prints something and exits 0 before any job exists, as --help (nothing to fault)


@dataclass(frozen=True)
class FlagRow:
    flag: str                              # the canonical (first long) option string of the parser
    args: tuple[str, ...] = ()             # what the agents get (with placeholders)
    outcome: str = BITWISE
    job: str = ""                          # CI job sharing this row's run ("" for BASE / REFUSED rows)
    single_node: bool = False              # one agent, 4 workers, coordinating by the flag itself
    script: tuple[str, ...] = ()           # replaces "{train} {out}" (how the flag runs the script)
    note: str = ""


ROWS: tuple[FlagRow, ...] = (
    # --- sizes and rendezvous ---------------------------------------------------------
    FlagRow("--nnodes", ("--nnodes", "2:3"), job="elastic", note="MIN:MAX closes at 2 nodes after the last call"),
    FlagRow("--nproc-per-node", outcome=BASE),
    FlagRow("--rdzv-backend", ("--rdzv-backend", "etcd"), job="elastic", note="alias of ckptless"),
    FlagRow("--rdzv-endpoint", outcome=BASE),
    FlagRow("--rdzv-id", outcome=BASE),
    FlagRow("--rdzv-conf", ("--rdzv-conf", "join_timeout=90"), job="elastic"),
    FlagRow("--standalone", ("--standalone",), job="standalone", single_node=True),
    FlagRow("--node-rank", ("--rdzv-backend", "static", "--node-rank", "0"), job="static", single_node=True),
    FlagRow("--master-addr", ("--rdzv-backend", "static", "--master-addr", "127.0.0.1"), job="static",
            single_node=True),
    FlagRow("--master-port", ("--rdzv-backend", "static", "--master-port", "{port}"), job="static", single_node=True),
    FlagRow("--local-addr", ("--local-addr", "127.0.0.1"), job="elastic"),
    # --- worker lifecycle (torchrun's) ---------------------------------------------------
    FlagRow("--max-restarts", ("--max-restarts", "3"), job="elastic",
            note="recovery is in place; the value only reaches TORCHELASTIC_MAX_RESTARTS"),
    FlagRow("--monitor-interval", ("--monitor-interval", "0.5"), job="telemetry"),
    FlagRow("--start-method", ("--start-method", "fork"), job="elastic", note="workers are always exec'd"),
    FlagRow("--event-log-handler", ("--event-log-handler", "console"), outcome=REFUSED),
    FlagRow("--role", ("--role", "trainer"), job="telemetry"),
    FlagRow("--module", ("--module",), job="mirror", script=("tests.harness.scripts.train_ref", "{out}")),
    FlagRow("--no-python", ("--no-python",), job="telemetry", script=("{python}", "{train}", "{out}")),
    FlagRow("--run-path", ("--run-path",), job="snapshot"),
    FlagRow("--log-dir", ("--log-dir", "{out}/logs"), job="telemetry"),
    FlagRow("--redirects", ("--redirects", "3"), job="telemetry"),
    FlagRow("--tee", ("--tee", "0:1"), job="telemetry"),
    FlagRow("--local-ranks-filter", ("--local-ranks-filter", "0"), job="telemetry"),
    FlagRow("--duplicate-stdout-filters", ("--duplicate-stdout-filters", "x"), outcome=REFUSED),
    FlagRow("--duplicate-stderr-filters", ("--duplicate-stderr-filters", "x"), outcome=REFUSED),
    FlagRow("--logs-specs", ("--logs-specs", "my.plugin"), outcome=REFUSED),
    FlagRow("--numa-binding", ("--numa-binding", "node"), outcome=REFUSED),
    FlagRow("--log-line-prefix-template", ("--log-line-prefix-template", "[${rank}]"), outcome=REFUSED,
            note="torchrun 2.14's"),
    FlagRow("--print-completion", ("--print-completion", "bash"), outcome=PRINTS, note="torchrun 2.14's"),
    FlagRow("--signals-to-handle", ("--signals-to-handle", "SIGTERM,SIGINT"), job="telemetry"),
    FlagRow("--shutdown-timeout", ("--shutdown-timeout", "5"), job="telemetry"),
    FlagRow("--virtual-local-rank", ("--virtual-local-rank",), job="elastic"),
    # --- ckptless ---------------------------------------------------------------------
    FlagRow("--replicas", ("--replicas", "2"), job="mirror"),
    FlagRow("--mirror-every", ("--mirror-every", "2"), job="mirror"),
    FlagRow("--placement", ("--placement", "mixed"), job="mirror"),
    FlagRow("--shm-dir", ("--shm-dir", "{shm}"), job="mirror"),
    FlagRow("--on-replica-mismatch", ("--on-replica-mismatch", "replace"), job="mirror",
            note="with its own fault (a bit flipped in one DDP replica): tests/e2e/test_ddp_fsdp_e2e.py"),
    FlagRow("--mirror-replicated", ("--mirror-replicated",), job="mirror",
            note="with its own fault (both HSDP replicas of a shard lost): tests/e2e/test_ddp_fsdp_e2e.py"),
    FlagRow("--no-shm-dir", ("--no-shm-dir",), job="telemetry", note="replicas in worker memory only"),
    FlagRow("--spares", ("--spares", "1"), job="spare-lazy"),
    FlagRow("--no-spare-prebuild", ("--spares", "1", "--no-spare-prebuild"), job="spare-lazy"),
    FlagRow("--spare-any-rank", ("--spares", "1", "--spare-any-rank"), job="spare-any"),
    FlagRow("--no-spare-any-rank", ("--spares", "1", "--no-spare-any-rank"), job="mirror",
            note="the spare, built as rank 0, restarts as the lost rank 1"),
    FlagRow("--spare-refill", ("--spares", "1", "--spare-any-rank", "--spare-refill"), job="spare-any"),
    FlagRow("--snapshot-every", ("--snapshot-every", "3", "--snapshot-dir", "{out}/snap"), job="snapshot"),
    FlagRow("--snapshot-dir", ("--snapshot-every", "3", "--snapshot-dir", "{out}/snap"), job="snapshot"),
    FlagRow("--fresh-start", ("--snapshot-every", "3", "--snapshot-dir", "{out}/snap", "--fresh-start"),
            job="snapshot", note="a fresh directory: nothing to set aside; a kill mid-run still recovers in place"),
    FlagRow("--goodput-dir", ("--goodput-dir", "{out}/goodput"), job="telemetry"),
    FlagRow("--hang-timeout", ("--hang-timeout", "20"), job="snapshot"),
    FlagRow("--lease-ttl", ("--lease-ttl", "1.5"), job="snapshot"),
    FlagRow("--node-grace", ("--node-grace", "4"), job="snapshot"),
    FlagRow("--replacement-timeout", ("--replacement-timeout", "120"), job="snapshot",
            note="the kill is respawned at once (no wait); a node lost with no spare waits for a new agent: "
                 "tests/e2e/test_replacement_node_e2e.py, and its deadline there"),
    FlagRow("--lost-node", ("--nnodes", "2:3", "--lost-node", "shrink"), job="elastic",
            note="a killed worker is respawned on its live node (nothing is lost for good, nothing shrinks); a node "
                 "lost with no spare goes on with fewer ranks and grows back: tests/e2e/test_shrink_e2e.py"),
    FlagRow("--metrics-port", ("--metrics-port", "0"), job="telemetry"),
    FlagRow("--no-warm-respawn", ("--no-warm-respawn",), job="snapshot"),
    FlagRow("--replicas=0", ("--replicas", "0"), outcome=ENDS, job="no-recovery",
            note="K = 0 turns recovery off: a kill ends the job like torchrun --max-restarts 0"),
)


@dataclass(frozen=True)
class EnvRow:
    """One of torch's NCCL variables that ckptless sets (ckptless/worker/nccl_env.py), set by the user instead:
    the value tried beside one SIGKILL (on the NCCL-semantics backend), and the outcome it must give."""

    var: str
    value: str
    outcome: str = BITWISE
    also: tuple[tuple[str, str], ...] = ()  # other variables the value needs (set with it)
    note: str = ""


ENV_ROWS: tuple[EnvRow, ...] = (
    EnvRow("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0", note="0 keeps the process too: accepted"),
    EnvRow("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1", outcome=REFUSED, note="torchrun's: tears survivors down"),
    EnvRow("TORCH_NCCL_ENABLE_MONITORING", "1", note="with dumping off only a stuck watchdog ends a process: warned"),
    EnvRow("TORCH_NCCL_DUMP_ON_TIMEOUT", "1", note="dumping with the monitor off ends nobody: accepted"),
    EnvRow("TORCH_NCCL_DUMP_ON_TIMEOUT", "1", outcome=REFUSED, also=(("TORCH_NCCL_ENABLE_MONITORING", "1"),),
           note="with the monitor on, every later replacement is ended"),
    EnvRow("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "500"),
    EnvRow("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "90"),
    EnvRow("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", "20", outcome=REFUSED,
           also=(("TORCH_NCCL_ENABLE_MONITORING", "1"), ("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "15000")),
           note="under the watchdog's post-error sleep, with the monitor on: a normal error looks like a hang"),
    EnvRow("TORCH_NCCL_LOG_CPP_STACK_ON_UNCLEAN_SHUTDOWN", "1"),
    EnvRow("TORCH_NCCL_NONBLOCKING_TIMEOUT", "45", note="the user's bound on an init in progress: kept"),
)


def env_job() -> dict[str, str]:
    """The one job that carries the accepted rows' values at once: each variable's first row, skipping a row
    whose value the ones before make a refused combination (accepted alone: checked apart)."""
    from ckptless.errors import ConfigError
    from ckptless.worker import nccl_env

    env: dict[str, str] = {}
    for r in ENV_ROWS:
        if r.outcome != BITWISE or r.var in env:
            continue
        candidate = {**env, r.var: r.value, **dict(r.also)}
        try:
            nccl_env.check(candidate)
        except ConfigError:
            continue
        env = candidate
    return env


def rows_by_flag() -> dict[str, FlagRow]:
    return {r.flag: r for r in ROWS if "=" not in r.flag}


def jobs() -> dict[str, list[FlagRow]]:
    """CI jobs: rows sharing one run (BASE and REFUSED rows need no run)."""
    out: dict[str, list[FlagRow]] = {}
    for r in ROWS:
        if r.outcome in (BITWISE, ENDS):
            out.setdefault(r.job, []).append(r)
    return out


def job_args(rows: list[FlagRow]) -> tuple[str, ...]:
    """The union of the rows' args, each option once (rows of one job agree on shared options)."""
    args: list[str] = []
    seen: set[str] = set()
    for row in rows:
        i = 0
        while i < len(row.args):
            opt = row.args[i]
            takes = i + 1 < len(row.args) and not row.args[i + 1].startswith("--")
            chunk = row.args[i:i + 2] if takes else row.args[i:i + 1]
            if opt not in seen:
                seen.add(opt)
                args.extend(chunk)
            i += len(chunk)
    return tuple(args)
