"""``ckptless-chaos``: chaos on your own script, the fault-injected demo, single scenarios and the matrix.

    ckptless-chaos run    SCENARIO --script PATH [--nnodes N] [--nproc-per-node N] [--spares N]
                          [--env K=V ...] [--rank R] [--at S[,S]] [--hang-timeout S] [--out DIR] [-- ARGS...]
    ckptless-chaos demo   [--out DIR] [--steps N]
    ckptless-chaos list
    ckptless-chaos run    NAME [--seed S] [--out DIR]     (NAME from `list`, or `random`: the matrix's demo job)
    ckptless-chaos run    long [--seed S] [--faults N] [--spares N] [--out DIR]   (>= 20 seeded faults in ONE job)
    ckptless-chaos matrix [--only a,b] [--seeds 1,2] [--out DIR]

Why one entry point for the demo and the matrix: the demo *is* a chaos
scenario (faults at exact steps, a fault-free twin, the bitwise verdict); it
only adds the goodput report. Exit status: 0 when every verdict is PASS,
1 when any FAIL, 2 for bad input (one line on stderr, no traceback).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from ckptless.chaos.cluster import DEMO_SCRIPT, ClusterSpec
from ckptless.chaos.scenario import (
    BaselineCache, Scenario, Verdict, render_fault_table, render_table, run_scenario,
)
from ckptless.chaos.script import (
    DEFAULT_HANG_TIMEOUT_S, SCRIPT_SCENARIOS, ScriptJob, describe, render_details, run_script,
)
from ckptless.chaos.schedule import (
    RANK_KINDS, Fault, FaultKind, LongConfig, ScheduleConfig, explicit_schedule, holders, independent,
    make_long_schedule, make_schedule,
)
from ckptless.errors import CkptlessError, ConfigError

STEPS = 12
PAIR = ScheduleConfig(steps=STEPS, max_concurrent=2)


def _independent_pair(cfg: ScheduleConfig) -> tuple[int, int]:
    hold = holders(cfg)
    for a in range(cfg.world_size):
        for b in range(a + 1, cfg.world_size):
            if independent(a, b, hold):
                return a, b
    raise ConfigError("world_size", cfg.world_size, "no two ranks in different placement groups")


def _one(name: str, fault: str, expected: str, spec: ClusterSpec, cfg: ScheduleConfig, faults: list[Fault],
         expect_disk: bool = False) -> Scenario:
    return Scenario(name, fault, expected, spec, explicit_schedule(cfg, faults), expect_disk)


PSTEPS = 400  # 40-70 ms a step here: the job trains on through a partition (backstop hold at step 390)
PARTITION_SHORT_S = 4.0   # > the 1 s lease TTL (the lease really expires), < TTL + the default 10 s grace
PARTITION_LONG_S = 12.0   # > TTL + LONG_GRACE_S: the leader gives the node up while it is cut off
LONG_GRACE_S = 3.0


def partition_scenarios() -> list[Scenario]:
    """Network partitions (netns clusters: one namespace per node, etcd on the root bridge)."""
    cfg = ScheduleConfig(steps=PSTEPS, kinds=(FaultKind.PARTITION_NODE_ETCD, FaultKind.PARTITION_WORKERS,
                                              FaultKind.PARTITION_NODES))
    ns = ClusterSpec(steps=PSTEPS, netns=True)
    return [
        Scenario("partition-etcd-short",
                 f"cut node 1 (ranks 2-3) from etcd at step 5 for {PARTITION_SHORT_S:g}s (drop)",
                 "lease lost and renewed; no incident, generation 0; bitwise equal", ns,
                 explicit_schedule(cfg, [Fault(5, FaultKind.PARTITION_NODE_ETCD, (2,), PARTITION_SHORT_S, "drop")]),
                 generation=(0, 0)),
        Scenario("partition-etcd-long",
                 f"cut node 1 from etcd at step 5 for {PARTITION_LONG_S:g}s (drop), --node-grace {LONG_GRACE_S:g}",
                 "node given up after the grace: ranks 2-3 re-planned (bitwise equal) or a clear end",
                 ClusterSpec(steps=PSTEPS, netns=True, node_grace=LONG_GRACE_S),
                 explicit_schedule(cfg, [Fault(5, FaultKind.PARTITION_NODE_ETCD, (2,), PARTITION_LONG_S, "drop")]),
                 generation=(1, None), end_causes=("lost their lease", "no replacement")),
        Scenario("partition-etcd-permanent",
                 f"cut node 1 from etcd at step 5 for good (drop), --node-grace {LONG_GRACE_S:g}; spare node",
                 "2 spares take ranks 2-3 (bitwise equal); the cut-off agent exits by itself",
                 ClusterSpec(steps=PSTEPS, netns=True, node_grace=LONG_GRACE_S, spare_nodes=1,
                             spares_per_spare_node=2),
                 explicit_schedule(cfg, [Fault(5, FaultKind.PARTITION_NODE_ETCD, (2,), None, "drop")]),
                 generation=(1, None), run_timeout_s=150.0),
        Scenario("partition-workers",
                 f"cut worker traffic node 0 <-> node 1 (store kept) at step 5 for {PARTITION_SHORT_S:g}s (TCP reset)",
                 "collectives break, survivors report, same membership re-formed; bitwise equal", ns,
                 explicit_schedule(cfg, [Fault(5, FaultKind.PARTITION_WORKERS, (1, 2), PARTITION_SHORT_S, "reset")]),
                 generation=(1, None)),
        Scenario("partition-workers-permanent",
                 "cut worker traffic node 0 <-> node 1 (store kept) at step 5 for good (TCP reset)",
                 "the job cannot re-form: it ends, naming the unreachable peers (connect errors)", ns,
                 explicit_schedule(cfg, [Fault(5, FaultKind.PARTITION_WORKERS, (1, 2), None, "reset")]),
                 generation=(1, None), end_causes=("connect",), run_timeout_s=180.0),
        Scenario("partition-nodes",
                 f"cut ALL traffic node 0 <-> node 1 (Gloo + store) at step 5 for {PARTITION_SHORT_S:g}s (TCP reset)",
                 "collectives break; after the heal the same membership re-forms; bitwise equal", ns,
                 explicit_schedule(cfg, [Fault(5, FaultKind.PARTITION_NODES, (1, 2), PARTITION_SHORT_S, "reset")]),
                 generation=(1, None)),
    ]


def random_scenario(seed: int, faults: int = 2, steps: int = STEPS) -> Scenario:
    """Seeded kills and hangs on 2 nodes x 2 workers; concurrent victims only in distinct groups."""
    cfg = ScheduleConfig(steps=steps, faults=faults, max_concurrent=2, kinds=RANK_KINDS, first_step=3, min_gap=3)
    sched = make_schedule(cfg, seed)
    desc = "; ".join(f.describe() for f in sched.faults)
    return Scenario(f"random-s{seed}", desc, "every fault recovered from memory; bitwise equal",
                    ClusterSpec(steps=steps, hang_timeout=2.0), sched)


LONG_SEED = 1
LONG_HANG_TIMEOUT_S = 3.0


def long_config(faults: int = LongConfig.faults, spares: int = LongConfig.spares) -> LongConfig:
    """2 nodes x 2 workers + one spare-only node with 4 warm spares (one per rank: the node loss and
    the leader loss need them all; see LongConfig); ~10 steps per incident."""
    steps = max(LongConfig.steps, LongConfig.first_step + 10 * faults)
    return LongConfig(steps=steps, faults=faults, spares=spares)


def long_scenario(seed: int = LONG_SEED, faults: int = LongConfig.faults, spares: int = LongConfig.spares) -> Scenario:
    """ONE job, ``faults`` seeded faults: kills, hangs, two concurrent kills, a node loss, a leader
    loss and a kill during recovery (docs/chaos.md, "The long run")."""
    cfg = long_config(faults, spares)
    sched = make_long_schedule(cfg, seed)
    kinds = sorted({f.kind.value for f in sched.faults})
    spec = ClusterSpec(steps=cfg.steps, hang_timeout=LONG_HANG_TIMEOUT_S, spare_nodes=1,
                       spares_per_spare_node=cfg.spares)
    return Scenario(f"long-s{seed}", f"{len(sched.faults)} seeded faults in one job ({', '.join(kinds)})",
                    "every fault recovered (spares, respawns); bitwise equal", spec, sched,
                    run_timeout_s=600.0, whole_node=True)


def catalogue() -> dict[str, Scenario]:
    """The chaos matrix (docs/chaos.md). 2 nodes x 2 workers, K=1 ring, unless noted."""
    base = ClusterSpec(steps=STEPS)
    cfg = ScheduleConfig(steps=STEPS)
    node_cfg = ScheduleConfig(steps=STEPS, max_concurrent=2, kinds=(FaultKind.KILL_AGENT, FaultKind.KILL_LEADER),
                              spare_slots=2)
    with_spares = ClusterSpec(steps=STEPS, spare_nodes=1, spares_per_spare_node=2)
    a, b = _independent_pair(PAIR)
    holder = holders(cfg)[0][0]
    items = [
        _one("kill-worker", "SIGKILL rank 1 at step 5", "respawned on its node; survivors keep their pids",
             base, cfg, [Fault(5, FaultKind.KILL_WORKER, (1,))]),
        _one("hang-worker", "SIGSTOP rank 2 at step 4 (--hang-timeout 2)", "watchdog kills it; replaced",
             ClusterSpec(steps=STEPS, hang_timeout=2.0), cfg, [Fault(4, FaultKind.HANG_WORKER, (2,))]),
        _one("node-loss", "SIGKILL the agent of ranks 2-3 at step 6", "2 warm spares on a spare node take 2-3",
             with_spares, node_cfg, [Fault(6, FaultKind.KILL_AGENT, (2,))]),
        _one("leader-loss", "SIGKILL the leading agent (ranks 0-1) at step 6", "new leader elected; spares take 0-1",
             with_spares, node_cfg, [Fault(6, FaultKind.KILL_LEADER, (0,))]),
        _one("etcd-restart", "SIGKILL + restart etcd at step 5", "no rank lost; generation stays 0",
             base, ScheduleConfig(steps=STEPS, kinds=(FaultKind.RESTART_ETCD,)),
             [Fault(5, FaultKind.RESTART_ETCD, (0,))]),
        _one("two-groups", f"SIGKILL ranks {a} and {b} at step 5 (distinct groups)", "both rebuilt from memory",
             base, PAIR, [Fault(5, FaultKind.KILL_WORKER, (a, b))]),
        _one("beyond-k-disk", f"SIGKILL ranks 0 and {holder} (its only holder) at step 7, --snapshot-every 2, "
             "--no-shm-dir", "mirror lost: fall back to the disk snapshot (the node-local tier, on by default, "
             "would have kept both images)", ClusterSpec(steps=STEPS, snapshot_every=2, agent_args=("--no-shm-dir",)),
             ScheduleConfig(steps=STEPS, max_concurrent=2, allow_beyond_k=True),
             [Fault(7, FaultKind.KILL_WORKER, (0, holder))], expect_disk=True),
        _one("spare-any-refill", "SIGKILL rank 1 at step 4, rank 2 at step 9; one spare, --spare-any-rank "
             "--spare-refill", "the spare (built as rank 0) takes rank 1 in place; a refilled one takes rank 2",
             ClusterSpec(steps=STEPS, spare_nodes=1, spares_per_spare_node=1,
                         spare_node_args=("--spare-any-rank", "--spare-refill")),
             cfg, [Fault(4, FaultKind.KILL_WORKER, (1,)), Fault(9, FaultKind.KILL_WORKER, (2,))]),
        *partition_scenarios(),
    ]
    return {s.name: s for s in items}


DEMO_STEPS = 1000  # ~50 ms a step here (2 x 2 workers on 2 cores): ~50 s of training per run


def demo_job(steps: int) -> ScriptJob:
    """2 agents x 2 workers plus a spare-only node with 2 warm spares (any rank), the demo transformer.

    Why two spares on their own node: a lost node takes both its ranks at once and a dead
    node cannot respawn them (a rank is respawned only on its own live node), so the node
    loss needs as many warm spares as the node had ranks, on a node that survives it.
    """
    if steps < 20:
        raise ConfigError("steps", steps, "the demo needs >= 20 steps (three faults, each after the last recovery)")
    return ScriptJob(DEMO_SCRIPT, ("{out}",), nnodes=2, nproc_per_node=2, spares=2,
                     env={"DEMO_STEPS": str(steps), "DEMO_WIDTH": "32"}, hang_timeout=3.0,
                     # the demo's setup is the same on every rank (it reads job.rank after it): the spares,
                     # pre-built as ranks 0 and 1, take the lost node's ranks 2 and 3 in place
                     spare_args=("--spare-any-rank",))


def demo_faults(steps: int) -> list[Fault]:
    """Node loss first (it needs both spares), then a worker kill and a hang on the surviving node
    (no spare left: both are respawned there, warm)."""
    return [Fault(steps // 5, FaultKind.KILL_AGENT, (2,)),
            Fault(steps // 2, FaultKind.KILL_WORKER, (1,)),
            Fault((4 * steps) // 5, FaultKind.HANG_WORKER, (0,))]


def _out_dir(arg: str | None, what: str) -> Path:
    if arg:
        return Path(arg).resolve()
    return Path(tempfile.mkdtemp(prefix=f"ckptless-chaos-{what}-"))


def _run_all(scenarios: list[Scenario], out: Path) -> list[Verdict]:
    cache = BaselineCache(out)
    verdicts = []
    for sc in scenarios:
        v = run_scenario(sc, out, cache)
        print(f"[{sc.name}] {'PASS' if v.passed else 'FAIL'} in {v.wall_s:.0f}s", flush=True)
        verdicts.append(v)
    return verdicts


def _demo(args: argparse.Namespace) -> int:
    from ckptless.cli import main as ckptless_cli
    from ckptless.report.loader import load_run
    from ckptless.report.model import build_report

    out = _out_dir(args.out, "demo")
    job = demo_job(args.steps)
    faults = demo_faults(args.steps)
    t0 = time.monotonic()
    print(f"ckptless demo: {job.nnodes} nodes x {job.nproc_per_node} workers + a spare node with {job.spares} warm "
          f"spares, embedded etcd, {args.steps} steps of examples/train_demo.py (tiny transformer)", flush=True)
    print(f"  faults: {'; '.join(describe(f) for f in faults)} (--hang-timeout {job.hang_timeout:g})", flush=True)
    print(f"  output: {out}", flush=True)
    v = run_script("demo", job, out, faults=lambda _steps: faults, log=lambda line: print(line, flush=True))
    goodput = out / "demo" / "goodput"
    html = out / "report.html"
    print(f"\n== goodput report of the faulty run (ckptless report {goodput} --html {html}) ==", flush=True)
    if goodput.is_dir():
        ckptless_cli(["report", str(goodput), "--html", str(html)])
        sys.stdout.flush()
        rep = build_report(load_run(goodput))
        a, e = rep.analysis, rep.estimate
        print(f"\n== ckptless vs restart-from-disk, same {len(a.incidents)} failures ==")
        print(f"goodput with ckptless: {a.goodput:.1%} (measured: {a.productive_s:.1f}s productive of "
              f"{a.wall_s:.1f}s; failures cost {e.ckptless_failure_s:.1f}s)")
        print(f"goodput restarting from disk: {e.goodput:.1%} (ESTIMATE: failures would cost "
              f"{e.failure_badput_s:.1f}s -- restart {e.inputs.restart_s:g}s + load {e.inputs.load_s:g}s + "
              f"warm-up {e.warmup_s:.1f}s + steps since a checkpoint every {e.inputs.interval_steps} steps, each; "
              f"see the report's estimate inputs)")
        print(f"HTML report: {html}")
    print("\n== verdict: faulty run vs fault-free run (library digest of every protected object, RNG included) ==")
    print(render_details(v), end="")
    print(v.line)
    print(f"demo {'PASSED' if v.passed else 'FAILED'} in {time.monotonic() - t0:.0f}s")
    return 0 if v.passed else 1


def _long(args: argparse.Namespace) -> int:
    """``run long [--seed S] [--faults N]``: the schedule first, then the run, the per-fault table,
    wall time and load average."""
    seed = _seed(args.seed if args.seed != "0" else str(LONG_SEED))
    sc = long_scenario(seed, args.faults or LongConfig.faults, LongConfig.spares if args.spares is None else args.spares)
    out = _out_dir(args.out, "long")
    spec = sc.spec
    print(f"ckptless-chaos long run, seed {seed}: {spec.nodes} nodes x {spec.nproc_per_node} workers + a spare node "
          f"with {spec.spares_per_spare_node} warm spares, {spec.steps} steps, --hang-timeout {spec.hang_timeout:g}; "
          f"output {out}", flush=True)
    for f, e in zip(sc.schedule.faults, sc.schedule.expect):
        print(f"  {f.describe()}  -> model: ranks {list(e.lost)} to {'/'.join(e.to)}", flush=True)
    t0 = time.monotonic()
    v = _run_all([sc], out)[0]
    print(render_table([v]), end="")
    print(render_fault_table(v), end="")
    load = ", ".join(f"{x:.1f}" for x in v.load)
    print(f"wall {time.monotonic() - t0:.0f}s (faulty run {v.faulty_s:.0f}s); 1-min load average {load} "
          f"(start, after each fault step, end); final generation {v.generation}", flush=True)
    return 0 if v.passed else 1


def _env_pairs(items: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError("env", item, "expected KEY=VALUE")
        env[key] = value
    return env


def _steps_list(text: str | None) -> list[int]:
    if not text:
        return []
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError("at", text, "expected step numbers, comma-separated") from None


def _run_script(args: argparse.Namespace, script_args: list[str]) -> int:
    spares = args.spares
    if spares is None:
        spares = args.nproc_per_node if args.name == "kill-node" else 0
    job = ScriptJob(Path(args.script).resolve(), tuple(script_args), nnodes=args.nnodes,
                    nproc_per_node=args.nproc_per_node, spares=spares, env=_env_pairs(args.env or []),
                    hang_timeout=args.hang_timeout)
    out = _out_dir(args.out, f"{args.name}-script")
    v = run_script(args.name, job, out, rank=args.rank, at=_steps_list(args.at), timeout_s=args.timeout,
                   log=lambda line: print(line, flush=True))
    print(render_details(v), end="")
    print(v.line, flush=True)
    return 0 if v.passed else 1


def _pick(names: str | None, seeds: str | None) -> list[Scenario]:
    cat = catalogue()
    chosen = list(cat.values())
    if names:
        wanted = [n.strip() for n in names.split(",") if n.strip()]
        for n in wanted:
            if n not in cat and n != "random":
                raise ConfigError("only", n, f"unknown scenario; one of {sorted(cat)}")
        chosen = [cat[n] for n in wanted if n in cat]
    for s in (seeds or "").split(","):
        if s.strip():
            chosen.append(random_scenario(_seed(s)))
    return chosen


def _seed(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError("seed", text, "must be an integer") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptless-chaos", description="fault injection for ckptless jobs")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="the fault-injected demo (what `make demo` runs)")
    d.add_argument("--out", help="output directory (default: a fresh temp dir)")
    d.add_argument("--steps", type=int, default=DEMO_STEPS, help=f"training steps (default {DEMO_STEPS})")
    sub.add_parser("list", help="list the scenarios (for --script, and of the matrix)")
    r = sub.add_parser("run", help="run one scenario against its fault-free twin: on your script (--script) "
                                   "or on the matrix's demo job",
                       usage="ckptless-chaos run SCENARIO [--script PATH ...] [-- SCRIPT_ARGS...]")
    r.add_argument("name", help=f"with --script: one of {', '.join(SCRIPT_SCENARIOS)}; "
                                "else a matrix scenario (see `list`) or `random`")
    r.add_argument("--script", help="your training script (uses ckptless.init/protect/run or job.steps/guard "
                                    "and closes its job); its arguments go after `--` ({out}: the run's dir)")
    r.add_argument("--nnodes", type=int, default=2, help="agents (nodes) running workers (default 2)")
    r.add_argument("--nproc-per-node", type=int, default=2, help="workers per node (default 2)")
    r.add_argument("--spares", type=int, default=None,
                   help="warm spares on one extra spare-only node (default 0; kill-node: --nproc-per-node; "
                        f"`long`: {LongConfig.spares})")
    r.add_argument("--env", action="append", metavar="KEY=VALUE",
                   help="environment of the script in both runs (repeatable), e.g. its step count")
    r.add_argument("--rank", type=int, default=None, help="victim rank (default: the last rank)")
    r.add_argument("--at", metavar="STEP[,STEP]",
                   help="fault step(s) (default: 1/3 of the run; kill-node 1/2; kill-twice 1/3 and 2/3)")
    r.add_argument("--hang-timeout", type=float, default=None,
                   help=f"agents' --hang-timeout in the faulty run (default {DEFAULT_HANG_TIMEOUT_S:g} for "
                        "hang-worker, else off)")
    r.add_argument("--timeout", type=float, default=None,
                   help="seconds a run may take (default: 4x the fault-free run, >= 300)")
    r.add_argument("--seed", default="0", help=f"seed of `random` (default 0) or `long` (default {LONG_SEED}); "
                                               "matrix scenarios only")
    r.add_argument("--faults", type=int, default=None,
                   help=f"`long` only: number of faults (default {LongConfig.faults})")
    r.add_argument("--out", help="output directory")
    m = sub.add_parser("matrix", help="run the chaos matrix; non-zero exit if any scenario fails")
    m.add_argument("--only", help="comma-separated scenario names")
    m.add_argument("--seeds", help="also run `random` with these seeds (comma-separated)")
    m.add_argument("--out", help="output directory")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if "--" in argv:  # everything after the first `--` belongs to the user's script
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1:]
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    if script_args and not (args.command == "run" and args.script):
        print("ckptless-chaos: error: arguments after `--` go to a --script", file=sys.stderr)
        return 2
    try:
        if args.command == "demo":
            return _demo(args)
        if args.command == "list":
            print("for `run SCENARIO --script PATH` (your script; steps are fractions of its run):")
            for ss in SCRIPT_SCENARIOS.values():
                print(f"  {ss.name:12} {ss.fault}  ->  {ss.expected}")
            print("the matrix (examples/train_demo.py, 2 nodes x 2 workers):")
            for sc in catalogue().values():
                print(f"  {sc.name:14} {sc.fault}  ->  {sc.expected}")
            print(f"  {'random':14} seeded kills/hangs (--seed S)")
            print(f"  {'long':14} {LongConfig.faults} seeded faults in one job: kills, hangs, node loss, leader loss, "
                  f"a kill during recovery (--seed S, --faults N)")
            return 0
        if args.command == "run" and args.script:
            return _run_script(args, script_args)
        if args.command == "run" and args.name == "long":
            return _long(args)
        if args.command == "run":
            scs = [random_scenario(_seed(args.seed))] if args.name == "random" else _pick(args.name, None)
            verdicts = _run_all(scs, _out_dir(args.out, args.name))
        else:
            verdicts = _run_all(_pick(args.only, args.seeds), _out_dir(args.out, "matrix"))
        print(render_table(verdicts), end="")
        return 0 if all(v.passed for v in verdicts) else 1
    except CkptlessError as exc:
        print(f"ckptless-chaos: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
