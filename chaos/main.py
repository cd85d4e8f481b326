"""``ckptless-chaos``: the fault-injected demo, single scenarios and the chaos matrix.

    ckptless-chaos demo   [--out DIR] [--steps N]
    ckptless-chaos list
    ckptless-chaos run    NAME [--seed S] [--out DIR]     (NAME from `list`, or `random`)
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

from ckptless.chaos.cluster import ClusterSpec
from ckptless.chaos.scenario import BaselineCache, Scenario, Verdict, render_table, run_scenario
from ckptless.chaos.schedule import (
    RANK_KINDS, Fault, FaultKind, ScheduleConfig, explicit_schedule, holders, independent, make_schedule,
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
        _one("beyond-k-disk", f"SIGKILL ranks 0 and {holder} (its only holder) at step 7, --snapshot-every 2",
             "mirror lost: fall back to the disk snapshot", ClusterSpec(steps=STEPS, snapshot_every=2),
             ScheduleConfig(steps=STEPS, max_concurrent=2, allow_beyond_k=True),
             [Fault(7, FaultKind.KILL_WORKER, (0, holder))], expect_disk=True),
        *partition_scenarios(),
    ]
    return {s.name: s for s in items}


def demo_scenario(steps: int, spare: bool = False) -> Scenario:
    """4 workers on one node (optionally plus a warm spare): kill -9 one worker, later freeze another.

    The spare is off by default: an agent whose dead worker's rank was adopted by
    a spare keeps that rank in its slot table and never exits (reported to the
    launcher's owner); respawns on the node exercise the same recovery path.
    """
    if steps < 12:
        raise ConfigError("steps", steps, "the demo needs >= 12 steps (faults at 1/4 and 2/3 of the run)")
    spec = ClusterSpec(nodes=1, nproc_per_node=4, spares_per_node=int(spare), hang_timeout=3.0, steps=steps)
    cfg = ScheduleConfig(steps=steps, world_size=4, nproc_per_node=4, kinds=RANK_KINDS)
    kill, hang = steps // 4, (2 * steps) // 3
    return Scenario("demo", f"SIGKILL rank 1 at step {kill}; SIGSTOP rank 2 at step {hang}",
                    ("spare takes rank 1" if spare else "rank 1 respawned") + ", rank 2 respawned; bitwise equal", spec,
                    explicit_schedule(cfg, [Fault(kill, FaultKind.KILL_WORKER, (1,)),
                                            Fault(hang, FaultKind.HANG_WORKER, (2,))]))


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

    out = _out_dir(args.out, "demo")
    sc = demo_scenario(args.steps, args.spare)
    t0 = time.monotonic()
    spare = " + 1 warm spare" if args.spare else ""
    print(f"ckptless demo: {sc.spec.world_size} workers{spare} on one node, embedded etcd, "
          f"{sc.spec.steps} steps of examples/train_demo.py", flush=True)
    print(f"  faults: {sc.fault}", flush=True)
    print(f"  output: {out} (agent logs in {out / 'demo' / 'logs'})", flush=True)
    v = _run_all([sc], out)[0]
    print(f"\n== goodput report of the faulty run ({out / 'demo' / 'goodput'}) ==", flush=True)
    if (out / "demo" / "goodput").is_dir():
        ckptless_cli(["report", str(out / "demo" / "goodput")])
    sys.stdout.flush()
    print("\n== verdict: faulty run vs fault-free run (params, optimizer, LR, RNG, data position; torch.equal) ==")
    print(render_table([v]), end="")
    print(f"demo {'PASSED' if v.passed else 'FAILED'} in {time.monotonic() - t0:.0f}s")
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
    d.add_argument("--steps", type=int, default=24, help="training steps (default 24)")
    d.add_argument("--spare", action="store_true", help="add a warm spare to the node")
    sub.add_parser("list", help="list the scenarios of the matrix")
    r = sub.add_parser("run", help="run one scenario against its fault-free baseline")
    r.add_argument("name", help="scenario name (see `list`) or `random`")
    r.add_argument("--seed", default="0", help="seed of `random` (default 0)")
    r.add_argument("--out", help="output directory")
    m = sub.add_parser("matrix", help="run the chaos matrix; non-zero exit if any scenario fails")
    m.add_argument("--only", help="comma-separated scenario names")
    m.add_argument("--seeds", help="also run `random` with these seeds (comma-separated)")
    m.add_argument("--out", help="output directory")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    try:
        if args.command == "demo":
            return _demo(args)
        if args.command == "list":
            for sc in catalogue().values():
                print(f"{sc.name:14} {sc.fault}  ->  {sc.expected}")
            print(f"{'random':14} seeded kills/hangs (--seed S)")
            return 0
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
