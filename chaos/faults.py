"""Fault injectors: real signals on real processes, at exact steps.

Why pause points: a signal "around step 5" is a flaky test. The training
script (``examples/train_demo.py``) holds the victim rank just before the
scheduled step and announces its pid in ``OUT/chaos/paused_<tag>.json``; the
injector waits for that file (bounded), sends the signal, and writes
``OUT/chaos/release_<tag>`` so a victim that was only a sync point (an etcd
restart, a leader on another node) goes on. Targets are found from those
files, ``/proc`` and the job's etcd records -- never from library internals.

Partitions (netns clusters only, :mod:`ckptless.chaos.netns`): the cut is an
nftables table in the victim node's namespace, applied while the victims are
held, then the victims are released at once, so the job goes on training
*through* the partition (scenarios give it enough steps). A backstop pause
``HOLD_BEFORE_END`` steps before the end (``h<i>r<rank>``, on EVERY rank, so
nobody waits inside a collective for a held peer) keeps the job from
finishing before the heal on a slow machine. Healing runs on a timer owned
by the cluster (cancelled at teardown).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ckptless.chaos.cluster import Agent, ChaosTimeout, LocalCluster, wait_for
from ckptless.chaos.netns import NetTopology, Partition
from ckptless.chaos.proctable import descendants
from ckptless.chaos.schedule import Fault, FaultKind
from ckptless.errors import ConfigError
from ckptless.goodput import Event, EventKind
from ckptless.recovery import membership_from_json

PAUSE_TIMEOUT_S = 180.0  # from job start to the scheduled step, on a loaded 2-core machine
HOLD_BEFORE_END = 10  # a partition holds every rank this many steps before the end, until it heals
PERMANENT_HOLD_S = 20.0  # ... and, for a permanent cut, releases them after this long


@dataclass(frozen=True)
class Injection:
    """What was done, to whom, when (monotonic: comparable with the goodput ledgers on this host)."""

    fault: Fault
    t_monotonic: float
    pids: tuple[int, ...]
    agents_killed: tuple[int, ...]
    lost: tuple[int, ...]
    note: str
    may_lose: tuple[int, ...] = ()  # ranks a partition may cost (replaced: allowed, noted in the verdict)
    heal_after_s: float | None = None  # partitions: healed this long after t_monotonic (None: never)
    cut_off: tuple[int, ...] = ()  # agents cut from etcd for good: they must still exit on their own


def pause_tag(fault_index: int, rank: int) -> str:
    return f"f{fault_index}r{rank}"


def hold_tag(fault_index: int, rank: int) -> str:
    return f"h{fault_index}r{rank}"


def pause_spec(faults: tuple[Fault, ...], steps: int | None = None, world_size: int = 0) -> str:
    """``CHAOS_PAUSES`` for the training script: one pause per (fault, target rank), plus a
    partition's backstop hold on every rank ``HOLD_BEFORE_END`` steps before ``steps``
    (only when that step comes after the fault's). A kill during recovery pauses nobody at its step:
    it waits for the leader's hold instead (:func:`leader_points`)."""
    items = [f"{pause_tag(i, r)}:{r}:{f.step}" for i, f in enumerate(faults) for r in f.targets
             if f.kind is not FaultKind.KILL_IN_RECOVERY]
    for i, f in enumerate(faults):
        if f.kind.is_partition and steps is not None and steps - HOLD_BEFORE_END > f.step:
            items += [f"{hold_tag(i, r)}:{r}:{steps - HOLD_BEFORE_END}" for r in range(world_size)]
    return ",".join(items)


def _chaos_dir(out: Path) -> Path:
    return out / "chaos"


# --- the leader's hold (a kill during recovery) -------------------------------------------------
#
# The library's pause point ``leader:before_publish`` (ckptless/chaos_hooks.py) holds the leading
# agent after it planned a recovery and before it publishes it, if CKPTLESS_CHAOS_POINTS names it.
# Its marker file is its latch ("fires once per job"): while ``paused_<tag>.json`` exists nobody
# pauses there. So the runner creates the marker before the job starts (disarmed), and arms the hold
# for ONE chosen incident by deleting it (and the old release file) just before that incident's
# fault: the next plan any leader publishes -- that incident's -- holds until released. Disarmed
# again by the marker the leader itself writes. Re-arming is safe once training went on past that
# incident (the held leader has left its loop: it published).
LEADER_TAG = "lead"


def leader_points() -> str:
    """``CKPTLESS_CHAOS_POINTS`` for a cluster whose schedule has kills during recovery."""
    return f"{LEADER_TAG}=leader:before_publish"


def disarm_leader_hold(out: Path) -> None:
    d = _chaos_dir(out)
    d.mkdir(parents=True, exist_ok=True)
    (d / f"paused_{LEADER_TAG}.json").write_text(json.dumps({"disarmed": True}))


def arm_leader_hold(out: Path) -> None:
    d = _chaos_dir(out)
    (d / f"release_{LEADER_TAG}").unlink(missing_ok=True)
    (d / f"paused_{LEADER_TAG}.json").unlink(missing_ok=True)


def wait_leader_held(out: Path, timeout_s: float, alive: Callable[[], bool] | None = None) -> dict[str, object]:
    """The leader's marker once it holds before publishing: {pid, point, generation, t_wall}."""
    marker = _chaos_dir(out) / f"paused_{LEADER_TAG}.json"

    def held() -> bool:
        try:
            return "pid" in json.loads(marker.read_text())
        except (OSError, ValueError):
            return False
    wait_for(lambda: held() or (alive is not None and not alive()), timeout_s,
             f"the leader to hold before publishing ({marker})")
    if not held():
        raise ChaosTimeout("the job ended before its leader held before publishing a recovery")
    doc = json.loads(marker.read_text())
    return dict(doc)


def wait_paused(out: Path, tag: str, timeout_s: float = PAUSE_TIMEOUT_S,
                alive: Callable[[], bool] | None = None) -> dict[str, int]:
    """The pause marker of ``tag`` ({pid, rank, step}); ``alive``: give up at once when the job is gone."""
    marker = _chaos_dir(out) / f"paused_{tag}.json"
    wait_for(lambda: marker.exists() or (alive is not None and not alive()), timeout_s,
             f"pause point {tag} ({marker})")
    if not marker.exists():
        raise ChaosTimeout(f"the job ended before reaching pause point {tag} ({marker})")
    doc = json.loads(marker.read_text())
    return {k: int(doc[k]) for k in ("pid", "rank", "step")}


def release(out: Path, tag: str) -> None:
    d = _chaos_dir(out)
    d.mkdir(parents=True, exist_ok=True)
    (d / f"release_{tag}").touch()


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def kill_worker(pid: int) -> None:
    """SIGKILL: the worker vanishes mid-step; its agent reaps it and records the exit."""
    _signal(pid, signal.SIGKILL)


def hang_worker(pid: int) -> None:
    """SIGSTOP: alive but frozen; only the agent's ``--hang-timeout`` watchdog can turn it into a crash."""
    _signal(pid, signal.SIGSTOP)


def kill_agent(agent: Agent) -> None:
    """SIGKILL the agent alone: its workers die by PDEATHSIG, its lease expires -- a lost node."""
    _signal(agent.pid, signal.SIGKILL)


def kill_node(agent: Agent) -> tuple[int, ...]:
    """SIGKILL a whole node at once: the agent's process group and every descendant (workers, spares,
    the fork server; each worker runs in its own session, so the group alone is not the node).
    Returns the pids signalled (the agent first)."""
    tree = descendants(agent.pid)  # before the kill: orphans are re-parented away at once
    try:
        os.killpg(agent.pid, signal.SIGKILL)  # agents run in their own session: pgid == pid
    except (ProcessLookupError, PermissionError):
        _signal(agent.pid, signal.SIGKILL)
    for pid in tree:
        _signal(pid, signal.SIGKILL)
    return (agent.pid, *tree)


def record_injection(cluster: LocalCluster, inj: Injection) -> None:
    """Append a ``fault_injected`` event to the run's goodput dir (``chaos.jsonl``): the report then
    starts the incident at the injection and shows kill -> first step. Same monotonic clock as the
    ledgers on this host, plus the wall time for merging."""
    kind = "kill_node" if inj.fault.kind is FaultKind.KILL_AGENT and inj.note.startswith("SIGKILL node") \
        else inj.fault.kind.value
    target: str | int = inj.fault.targets[0] if len(inj.fault.targets) == 1 else ",".join(map(str, inj.fault.targets))
    if inj.agents_killed:
        target = f"agent{inj.agents_killed[0]} (ranks {','.join(map(str, inj.lost)) or '?'})"
    wall = time.time() - (time.monotonic() - inj.t_monotonic)
    ev = Event(EventKind.FAULT_INJECTED, inj.t_monotonic, None, 0, inj.fault.step,
               {"kind": kind, "target": target, "note": inj.note}, t_wall=wall)
    cluster.goodput_dir.mkdir(parents=True, exist_ok=True)
    with open(cluster.goodput_dir / "chaos.jsonl", "a", encoding="utf-8") as f:
        f.write(ev.to_json() + "\n")


def restart_etcd(cluster: LocalCluster) -> None:
    """SIGKILL the etcd server and start it again on the same ports and data dir."""
    if cluster.etcd is None:
        raise ConfigError("fault", FaultKind.RESTART_ETCD.value, "the cluster does not own its etcd server")
    cluster.etcd.kill()
    cluster.etcd.start()


def inject_step(cluster: LocalCluster, indexed: list[tuple[int, Fault]], snapshot_wait_s: float = 120.0,
                pause_timeout_s: float = PAUSE_TIMEOUT_S, whole_node: bool = False) -> list[Injection]:
    """Inject all faults scheduled for one step, concurrently (after every victim is held there).

    With disk snapshots on, a kill waits for one complete snapshot first:
    a fallback to disk needs something on disk to fall back to. ``whole_node``: a
    ``KILL_AGENT`` fault kills the agent's whole process tree at once (:func:`kill_node`)
    instead of the agent alone. Every injection is recorded in the run's goodput dir.
    """
    def alive() -> bool:
        return any(a.proc.poll() is None for a in cluster.agents)

    in_recovery = [(i, f) for i, f in indexed if f.kind is FaultKind.KILL_IN_RECOVERY]
    indexed = [(i, f) for i, f in indexed if f.kind is not FaultKind.KILL_IN_RECOVERY]
    held = {(i, r): wait_paused(cluster.out, pause_tag(i, r), pause_timeout_s, alive)
            for i, f in indexed for r in f.targets}
    if cluster.spec.snapshot_every:
        wait_for(lambda: any(cluster.snapshot_dir.rglob("COMPLETE.json")), snapshot_wait_s, "a complete snapshot")
    if "--spare-refill" in cluster.spec.spare_node_args:  # a refilled spare is what such a scenario checks
        want = cluster.spec.spare_nodes * cluster.spec.spares_per_spare_node
        wait_for(lambda: len(cluster.client().get_prefix(cluster.keyspace.spares_prefix)[0]) >= want,
                 snapshot_wait_s, f"{want} spare(s) offered again (--spare-refill)")
    if in_recovery:
        arm_leader_hold(cluster.out)  # this incident's plan is the next one any leader publishes
    done: list[Injection] = []
    try:
        try:
            for i, f in indexed:
                pids = tuple(held[(i, r)]["pid"] for r in f.targets)
                if f.kind.is_partition:
                    done.append(_partition(cluster, i, f, pids))
                else:
                    done.append(_inject_one(cluster, f, pids, whole_node))
                record_injection(cluster, done[-1])
        finally:
            for i, f in indexed:
                for r in f.targets:
                    release(cluster.out, pause_tag(i, r))
        for _, f in in_recovery:
            done.append(_kill_in_recovery(cluster, f, pause_timeout_s, alive))
            record_injection(cluster, done[-1])
    finally:
        if in_recovery:
            release(cluster.out, LEADER_TAG)  # never leave a leader held (its own bound is 120 s)
    return done


EXIT_RECORD_WAIT_S = 30.0


def _kill_in_recovery(cluster: LocalCluster, f: Fault, timeout_s: float, alive: Callable[[], bool]) -> Injection:
    """Wait until the leader holds before publishing the recovery, SIGKILL ``f.targets[0]`` (a survivor
    waiting for the new membership), wait until its agent recorded the exit in etcd (so the leader
    publishes a plan that is already stale), then release the leader."""
    doc = wait_leader_held(cluster.out, timeout_s, alive)
    rank = f.targets[0]
    recs = cluster.pids(rank)
    if not recs:
        raise ChaosTimeout(f"rank {rank}: no pids_rank{rank}.jsonl record to find its process by")
    pid = int(str(recs[-1]["pid"]))
    t = time.monotonic()
    kill_worker(pid)
    key = cluster.keyspace.worker_exit(rank)

    def recorded() -> bool:
        kv = cluster.client().get(key)
        try:
            return kv is not None and int(json.loads(kv.value).get("pid", -1)) == pid
        except (ValueError, TypeError, AttributeError):
            return False
    try:
        waited = f"its exit recorded after {wait_for(recorded, EXIT_RECORD_WAIT_S, f'the exit of rank {rank}'):.2f}s"
    except ChaosTimeout:
        waited = f"no exit record within {EXIT_RECORD_WAIT_S:g}s"
    cluster.note(f"kill during recovery: SIGKILL rank {rank} (pid {pid}) while the leader (pid {doc.get('pid')}) "
                 f"held before publishing generation {doc.get('generation')}; {waited}")
    release(cluster.out, LEADER_TAG)
    return Injection(f, t, (pid,), (), (rank,),
                     f"SIGKILL worker while the leader held before publishing generation {doc.get('generation')}; "
                     + waited)


def _inject_one(cluster: LocalCluster, f: Fault, pids: tuple[int, ...], whole_node: bool = False) -> Injection:
    t = time.monotonic()
    if f.kind is FaultKind.KILL_WORKER:
        for pid in pids:
            kill_worker(pid)
        return Injection(f, t, pids, (), f.targets, "SIGKILL worker")
    if f.kind is FaultKind.HANG_WORKER:
        for pid in pids:
            hang_worker(pid)
        return Injection(f, t, pids, (), f.targets, "SIGSTOP worker")
    if f.kind is FaultKind.KILL_AGENT:
        agent = cluster.agent_of_pid(pids[0])
        if agent is cluster.leader():
            note = "SIGKILL agent (it was leading)"
        else:
            note = "SIGKILL agent"
        lost = cluster.ranks_of(agent)
        t = time.monotonic()
        if whole_node:
            killed = kill_node(agent)
            note = f"SIGKILL node: agent{agent.index} and {len(killed) - 1} processes under it" + (
                " (it was leading)" if "leading" in note else "")
        else:
            kill_agent(agent)
        return Injection(f, t, pids, (agent.index,), lost, note)
    if f.kind is FaultKind.KILL_LEADER:
        agent = cluster.leader()
        lost = cluster.ranks_of(agent)
        t = time.monotonic()
        if whole_node:
            killed = kill_node(agent)
            return Injection(f, t, (), (agent.index,), lost, f"SIGKILL node of the leader: agent{agent.index} "
                             f"and {len(killed) - 1} processes under it")
        kill_agent(agent)
        return Injection(f, t, (), (agent.index,), lost, f"SIGKILL leader agent{agent.index}")
    if f.kind is FaultKind.RESTART_ETCD:
        restart_etcd(cluster)
        return Injection(f, t, (), (), (), f"etcd restarted in {time.monotonic() - t:.2f}s")
    raise ConfigError("fault", f.kind, "unknown fault kind")


# --- partitions ---------------------------------------------------------------------------------
def partition_node_etcd(cluster: LocalCluster, agent: Agent, mode: str = "drop") -> Partition:
    """Cut ``agent``'s namespace (the agent and its workers) from the etcd port; node<->node stays up."""
    return _net(cluster).cut_from_root(cluster.node_net(agent).index, cluster.etcd_port(), mode)


def partition_workers(cluster: LocalCluster, a: Agent, b: Agent, mode: str = "reset",
                      keep_store: bool = True) -> Partition:
    """Cut the traffic between two nodes; both still reach etcd.

    ``keep_store``: the current generation's store (hosted by an agent, from the
    ``membership`` record) stays reachable, so only worker<->worker (Gloo) traffic
    is cut; False cuts everything between the nodes, the store included.
    """
    keep: tuple[int, ...] = ()
    if keep_store:
        kv = cluster.client().get(cluster.keyspace.membership)
        if kv is None:
            raise ConfigError("membership", None, "no membership yet: cannot find the store to keep")
        keep = (membership_from_json(kv.value).store_port,)
    return _net(cluster).cut_between(cluster.node_net(a).index, cluster.node_net(b).index, mode, keep)


def _net(cluster: LocalCluster) -> NetTopology:
    if cluster.net is None:
        raise ConfigError("netns", False, "partitions need ClusterSpec(netns=True)")
    return cluster.net


def heal_later(cluster: LocalCluster, cut: Partition | None, after_s: float, then: list[str]) -> None:
    """On a timer owned by the cluster: heal ``cut`` (None: nothing to heal), then release ``then`` tags."""
    def run() -> None:
        if cut is not None:
            cut.heal()
            cluster.note(f"healed {cut.what}")
        for tag in then:
            release(cluster.out, tag)

    timer = threading.Timer(after_s, run)
    timer.daemon = True
    cluster.add_timer(timer)
    timer.start()


def _partition(cluster: LocalCluster, index: int, f: Fault, pids: tuple[int, ...]) -> Injection:
    agents = [cluster.agent_of_pid(pid) for pid in pids]
    if f.kind is FaultKind.PARTITION_NODE_ETCD:
        may_lose = cluster.ranks_of(agents[0])
        t = time.monotonic()
        cut = partition_node_etcd(cluster, agents[0], f.mode)
    else:
        if agents[0] is agents[1]:
            raise ConfigError("targets", f.targets, "both ranks run on the same node: nothing to partition")
        # A RST reaches only a socket that sends: a rank blocked in a receive on an idle
        # connection across the cut is never told, and the leader replaces it once it does
        # not report (a hung rank). Allowed; the verdict notes it.
        may_lose = cluster.ranks_of(agents[0]) + cluster.ranks_of(agents[1])
        t = time.monotonic()
        cut = partition_workers(cluster, agents[0], agents[1], f.mode,
                                keep_store=f.kind is FaultKind.PARTITION_WORKERS)
    cluster.note(f"cut {cut.what} ({f.mode})")
    hold = [hold_tag(index, r) for r in range(cluster.spec.world_size)]
    if f.duration_s is None:
        heal_later(cluster, None, PERMANENT_HOLD_S, hold)
    else:
        heal_later(cluster, cut, f.duration_s, hold)
    how = "permanent" if f.duration_s is None else f"healed after {f.duration_s:g}s"
    cut_off = (agents[0].index,) if f.kind is FaultKind.PARTITION_NODE_ETCD and f.duration_s is None else ()
    return Injection(f, t, pids, (), (), f"{f.mode} {cut.what}, {how}", may_lose=may_lose,
                     heal_after_s=f.duration_s, cut_off=cut_off)
