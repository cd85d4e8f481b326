"""The named chaos scenarios: the matrix, the partitions, ``random``, the long run and the demo.

Each is data -- a cluster shape, a schedule (hand-written and validated, or drawn from a seed)
and the one-line fault and expectation ``ckptless-chaos list`` prints -- built from the
schedule vocabulary (:mod:`ckptless.chaos.schedule`, :mod:`ckptless.chaos.long_schedule`).

Why its own module: what is run is not how it is run. The runner
(:mod:`ckptless.chaos.scenario`, :mod:`ckptless.chaos.script`) takes any scenario and the CLI
(:mod:`ckptless.chaos.main`) only picks them by name; a new scenario is one entry here, and
tests build the same scenarios without going through the command line.
"""

from __future__ import annotations

from ckptless.chaos.cluster import DEMO_SCRIPT, ClusterSpec
from ckptless.chaos.long_schedule import LongConfig, make_long_schedule
from ckptless.chaos.scenario import Scenario
from ckptless.chaos.schedule import (
    RANK_KINDS, Fault, FaultKind, ScheduleConfig, explicit_schedule, holders, independent, make_schedule,
)
from ckptless.chaos.script import ScriptJob
from ckptless.errors import ConfigError

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
                 ClusterSpec(steps=PSTEPS, netns=True, node_grace=LONG_GRACE_S,
                             agent_args=("--replacement-timeout", "60")),  # the default (600 s) outlasts a run
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
