"""Seeded fault schedules: pure functions of (config, seed).

Why pure and seeded: a chaos run that fails must be replayable exactly. The
schedule is drawn from ``random.Random(seed)`` only (no clock, no global RNG,
no I/O), so the same seed and config always give the same list of faults, and
a failing seed printed by the runner reproduces the same run.

A schedule is a list of :class:`Fault` ``(step, kind, targets)``. Faults at
the same step are *concurrent*; the number of ranks lost at one step never
exceeds ``max_concurrent`` and, unless ``allow_beyond_k``, concurrent victims
are chosen in different placement groups (neither holds the other's mirror),
so the loss is recoverable from memory.

This module holds the fault vocabulary every other chaos module speaks
(:class:`FaultKind`, :class:`Fault`, :class:`Schedule`) and the short schedules
drawn or written against :class:`ScheduleConfig`. Long schedules -- many faults
in one job, on a model of where the ranks run after each -- build on it in
:mod:`ckptless.chaos.long_schedule`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from enum import Enum

from ckptless.errors import ConfigError
from ckptless.mirror import compute_placement


class FaultKind(str, Enum):
    """What the injector does (see :mod:`ckptless.chaos.faults`)."""

    KILL_WORKER = "kill_worker"      # SIGKILL one worker process
    HANG_WORKER = "hang_worker"      # SIGSTOP one worker (the agent's hang detector must kill it)
    KILL_AGENT = "kill_agent"        # SIGKILL a whole non-leading agent: node loss
    KILL_LEADER = "kill_leader"      # SIGKILL the agent currently leading the election
    RESTART_ETCD = "restart_etcd"    # SIGKILL + restart the etcd server (same data dir and ports)
    PARTITION_NODE_ETCD = "partition_node_etcd"  # cut one node (agent + workers) from etcd only
    PARTITION_WORKERS = "partition_workers"      # cut worker<->worker traffic of two nodes (the store stays up)
    PARTITION_NODES = "partition_nodes"          # cut ALL node<->node traffic (Gloo and the agents' store)
    # SIGKILL one more worker while the coordinator leader holds before publishing the recovery of
    # the fault at the same step (``leader:before_publish``): a second failure DURING a recovery.
    KILL_IN_RECOVERY = "kill_in_recovery"

    @property
    def loses_node(self) -> bool:
        return self in (FaultKind.KILL_AGENT, FaultKind.KILL_LEADER)

    @property
    def is_partition(self) -> bool:
        """Needs a netns cluster (``ClusterSpec(netns=True)``); kills nothing by itself."""
        return self in (FaultKind.PARTITION_NODE_ETCD, FaultKind.PARTITION_WORKERS, FaultKind.PARTITION_NODES)

    @property
    def loses_ranks(self) -> bool:
        """Whether the fault by itself destroys ranks (a partition or an etcd restart does not)."""
        return not (self is FaultKind.RESTART_ETCD or self.is_partition)


PARTITION_MODES = ("drop", "reset")


# Kinds that lose exactly the targeted ranks (node kinds lose a whole node's ranks).
RANK_KINDS = (FaultKind.KILL_WORKER, FaultKind.HANG_WORKER)


@dataclass(frozen=True)
class Fault:
    """One fault: at ``step`` (the victim is held just before running it), do ``kind`` to ``targets``.

    ``targets`` are global ranks; for node kinds it is the one rank whose
    agent is the victim (the rank is also where the runner synchronises).
    Partitions: ``PARTITION_NODE_ETCD`` cuts the node of ``targets[0]`` from etcd;
    ``PARTITION_WORKERS`` / ``PARTITION_NODES`` cut the nodes of ``targets[0]``
    and ``targets[1]`` from each other (workers only / everything). ``duration_s`` is how long the cut lasts (None: never
    healed); ``mode`` is ``drop`` (a black hole) or ``reset`` (TCP RST).
    ``KILL_IN_RECOVERY`` kills ``targets[0]`` during the recovery of the one-rank kill or hang at the
    same step: after the leader planned it and before it publishes (nobody pauses at the step for it).
    """

    step: int
    kind: FaultKind
    targets: tuple[int, ...]
    duration_s: float | None = None
    mode: str = "drop"

    def describe(self) -> str:
        who = ",".join(str(t) for t in self.targets)
        text = f"step {self.step}: {self.kind.value} rank {who}"
        if self.kind is FaultKind.KILL_IN_RECOVERY:
            text += " (while the leader holds before publishing)"
        if self.kind.is_partition:
            text += f" ({self.mode}, {'permanent' if self.duration_s is None else f'{self.duration_s:g}s'})"
        return text


@dataclass(frozen=True)
class ScheduleConfig:
    """Bounds of a random schedule.

    ``first_step`` leaves room for the first committed version (a fault before
    anything was mirrored is a start-up failure, not a recovery); ``min_gap``
    separates incidents so each recovery finishes before the next fault.
    """

    steps: int
    world_size: int = 4
    nproc_per_node: int = 2
    replicas: int = 1
    placement: str = "ring"
    faults: int = 2
    max_concurrent: int = 1
    kinds: tuple[FaultKind, ...] = RANK_KINDS
    first_step: int = 2
    min_gap: int = 2
    allow_beyond_k: bool = False
    spare_slots: int = 0
    partition_s: float = 4.0  # how long a drawn partition lasts

    def validate(self) -> None:
        int_at_least("steps", self.steps, 1)
        int_at_least("world_size", self.world_size, 2)
        int_at_least("nproc_per_node", self.nproc_per_node, 1)
        int_at_least("replicas", self.replicas, 1)
        int_at_least("faults", self.faults, 0)
        int_at_least("max_concurrent", self.max_concurrent, 1)
        int_at_least("first_step", self.first_step, 1)
        int_at_least("min_gap", self.min_gap, 1)
        int_at_least("spare_slots", self.spare_slots, 0)
        if self.world_size % self.nproc_per_node:
            raise ConfigError("nproc_per_node", self.nproc_per_node, f"must divide world_size={self.world_size}")
        if self.replicas >= self.world_size:
            raise ConfigError("replicas", self.replicas, f"must be < world_size={self.world_size}")
        if self.max_concurrent >= self.world_size:
            raise ConfigError("max_concurrent", self.max_concurrent, "must leave at least one survivor")
        if not self.kinds:
            raise ConfigError("kinds", self.kinds, "need at least one fault kind")
        for k in self.kinds:
            if not isinstance(k, FaultKind):
                raise ConfigError("kinds", k, f"not one of {[x.value for x in FaultKind]}")
        if FaultKind.KILL_IN_RECOVERY in self.kinds and self.max_concurrent < 2:
            raise ConfigError("max_concurrent", self.max_concurrent,
                              "a kill during recovery loses a second rank in the same incident")
        if any(k.is_partition for k in self.kinds) and self.world_size // self.nproc_per_node < 2:
            raise ConfigError("kinds", [k.value for k in self.kinds], "partitions need >= 2 worker nodes")
        if not self.partition_s > 0:
            raise ConfigError("partition_s", self.partition_s, "must be > 0 seconds")
        if any(k.loses_node for k in self.kinds):
            if self.world_size // self.nproc_per_node < 2:
                raise ConfigError("kinds", [k.value for k in self.kinds], "node loss needs >= 2 worker nodes")
            if self.spare_slots < self.nproc_per_node:
                raise ConfigError("spare_slots", self.spare_slots,
                                  f"node loss needs >= nproc_per_node={self.nproc_per_node} spares on another node")
            if self.nproc_per_node > self.max_concurrent:
                raise ConfigError("max_concurrent", self.max_concurrent,
                                  f"node loss kills nproc_per_node={self.nproc_per_node} ranks at once")
        last = self.first_step + max(self.faults - 1, 0) * self.min_gap
        if self.faults and last >= self.steps:
            raise ConfigError("faults", self.faults,
                              f"{self.faults} faults {self.min_gap} steps apart from step {self.first_step} "
                              f"do not fit in steps={self.steps}")


@dataclass(frozen=True)
class Expect:
    """What the layout simulation (:func:`ckptless.chaos.long_schedule.simulate`) predicts for one fault.

    ``lost``: the ranks it loses (a node fault: every rank on that node *then*); ``to``: per lost
    rank, ``spare`` (a warm spare on the spare node takes it) or ``respawn`` (on its own node);
    ``node``: the node hit (a node fault) or of the first victim; ``spares_left`` after it.
    """

    lost: tuple[int, ...]
    to: tuple[str, ...]
    node: str
    spares_left: int


@dataclass(frozen=True)
class Schedule:
    seed: int
    config: ScheduleConfig
    faults: tuple[Fault, ...] = field(default=())
    expect: tuple[Expect, ...] = field(default=())  # per fault, for schedules drawn with a layout model

    def lost_at(self, step: int) -> set[int]:
        """Ranks lost by the faults at ``step`` (a node fault loses its node's ranks)."""
        lost: set[int] = set()
        for i, f in enumerate(self.faults):
            if f.step == step and f.kind.loses_ranks:
                lost |= set(self.expect[i].lost) if self.expect else _lost_ranks(f, self.config.nproc_per_node)
        return lost


def int_at_least(name: str, value: object, low: int) -> None:
    """A bound of a schedule's config: an int (not a bool or float) >= ``low``, else a ConfigError naming it."""
    if type(value) is not int or value < low:
        raise ConfigError(name, value, f"must be an int >= {low}")


def _lost_ranks(f: Fault, per_node: int) -> set[int]:
    if f.kind.loses_node:
        node = f.targets[0] // per_node
        return set(range(node * per_node, (node + 1) * per_node))
    return set(f.targets)


def holders(cfg: ScheduleConfig) -> dict[int, tuple[int, ...]]:
    """rank -> ranks holding its mirror, from the library's own (pure) placement."""
    node_of = [r // cfg.nproc_per_node for r in range(cfg.world_size)]
    p = compute_placement(cfg.world_size, cfg.replicas, cfg.placement, node_of)
    return {r: tuple(p.holders(r)) for r in range(cfg.world_size)}


def independent(a: int, b: int, hold: dict[int, tuple[int, ...]]) -> bool:
    """Neither rank holds the other's mirror: losing both is recoverable from memory (K=1)."""
    return a != b and b not in hold[a] and a not in hold[b]


def _victims(rng: random.Random, cfg: ScheduleConfig, count: int, hold: dict[int, tuple[int, ...]]) -> tuple[int, ...]:
    ranks = list(range(cfg.world_size))
    for _ in range(64):  # a bounded search; with world >= 4 and ring K=1 it succeeds at once
        pick = tuple(sorted(rng.sample(ranks, count)))
        if cfg.allow_beyond_k or all(independent(a, b, hold) for a in pick for b in pick if a < b):
            return pick
    raise ConfigError("max_concurrent", count, f"no {count} ranks in distinct placement groups of world "
                      f"{cfg.world_size} with K={cfg.replicas}")


def make_schedule(cfg: ScheduleConfig, seed: int) -> Schedule:
    """Draw ``cfg.faults`` faults from ``random.Random(seed)``; same inputs, same schedule."""
    cfg.validate()
    int_at_least("seed", seed, 0)
    if FaultKind.KILL_IN_RECOVERY in cfg.kinds:
        raise ConfigError("kinds", FaultKind.KILL_IN_RECOVERY.value,
                          "a kill during recovery needs a primary fault at its step: make_long_schedule draws it")
    rng = random.Random(seed)
    hold = holders(cfg)
    # Steps: first_step + i * min_gap + a random share of the slack, kept in order.
    slack = cfg.steps - 1 - (cfg.first_step + max(cfg.faults - 1, 0) * cfg.min_gap)
    extra = sorted(rng.randint(0, max(slack, 0)) for _ in range(cfg.faults))
    faults: list[Fault] = []
    for i in range(cfg.faults):
        step = cfg.first_step + i * cfg.min_gap + extra[i]
        kind = rng.choice(cfg.kinds)
        per = cfg.nproc_per_node
        nodes = cfg.world_size // per
        if kind.loses_node or kind is FaultKind.RESTART_ETCD:
            # Any node may go; the runner resolves the leader at injection time.
            targets: tuple[int, ...] = (rng.randrange(1, nodes) * per if kind is FaultKind.KILL_AGENT else 0,)
        elif kind.is_partition:
            other = rng.randrange(1, nodes) * per
            targets = (other,) if kind is FaultKind.PARTITION_NODE_ETCD else (0, other)
            faults.append(Fault(step, kind, targets, cfg.partition_s,
                                "drop" if kind is FaultKind.PARTITION_NODE_ETCD else "reset"))
            continue
        else:
            count = rng.randint(1, cfg.max_concurrent)
            targets = _victims(rng, cfg, count, hold)
        faults.append(Fault(step, kind, targets))
    return Schedule(seed, cfg, tuple(faults))


def _check_partition(cfg: ScheduleConfig, f: Fault) -> None:
    if f.duration_s is not None and not f.duration_s > 0:
        raise ConfigError("duration_s", f.duration_s, "must be > 0 seconds (None: permanent)")
    if f.mode not in PARTITION_MODES:
        raise ConfigError("mode", f.mode, f"must be one of {PARTITION_MODES}")
    want = 1 if f.kind is FaultKind.PARTITION_NODE_ETCD else 2
    if len(f.targets) != want:
        raise ConfigError("targets", f.targets, f"{f.kind.value} takes {want} rank(s)")
    if want == 2 and f.targets[0] // cfg.nproc_per_node == f.targets[1] // cfg.nproc_per_node:
        raise ConfigError("targets", f.targets, "a workers partition needs ranks on two different nodes")


def explicit_schedule(cfg: ScheduleConfig, faults: list[Fault], seed: int = 0) -> Schedule:
    """A hand-written schedule, validated against the same bounds as a drawn one."""
    cfg.validate()
    hold = holders(cfg)
    for f in faults:
        if not 1 <= f.step < cfg.steps:
            raise ConfigError("step", f.step, f"must be in [1, {cfg.steps})")
        for t in f.targets:
            if not 0 <= t < cfg.world_size:
                raise ConfigError("target", t, f"must be a rank in [0, {cfg.world_size})")
        if f.kind.is_partition:
            _check_partition(cfg, f)
        if f.kind is FaultKind.KILL_IN_RECOVERY:
            check_in_recovery(f, [g for g in faults if g.step == f.step and g is not f])
    sched = Schedule(seed, cfg, tuple(sorted(faults, key=lambda f: f.step)))
    for step in {f.step for f in faults}:
        lost = sched.lost_at(step)
        if len(lost) > cfg.max_concurrent:
            raise ConfigError("max_concurrent", cfg.max_concurrent, f"step {step} loses ranks {sorted(lost)}")
        if not cfg.allow_beyond_k and not any(f.kind.loses_node for f in faults if f.step == step):
            pairs = [(a, b) for a in lost for b in lost if a < b]
            if not all(independent(a, b, hold) for a, b in pairs):
                raise ConfigError("targets", sorted(lost),
                                  f"step {step}: ranks share a placement group (set allow_beyond_k for disk fallback)")
    return sched


def check_in_recovery(f: Fault, same_step: list[Fault]) -> None:
    """A kill during recovery rides on exactly one one-rank kill or hang at its step (the recovery it
    lands in), and on nothing else there."""
    if len(f.targets) != 1:
        raise ConfigError("targets", f.targets, f"{f.kind.value} takes 1 rank")
    primary = [g for g in same_step if g.kind in RANK_KINDS and len(g.targets) == 1]
    if len(primary) != 1 or len(same_step) != 1:
        raise ConfigError("kind", f.kind.value, f"step {f.step}: a kill during recovery needs exactly one one-rank "
                          f"kill_worker/hang_worker at its step and nothing else (got {[g.kind.value for g in same_step]})")
    if primary[0].targets == f.targets:
        raise ConfigError("targets", f.targets, "the kill during recovery must hit another rank than the first fault")
