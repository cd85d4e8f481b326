"""Fault injectors: real signals on real processes, at exact steps.

Why pause points: a signal "around step 5" is a flaky test. The training
script (``examples/train_demo.py``) holds the victim rank just before the
scheduled step and announces its pid in ``OUT/chaos/paused_<tag>.json``; the
injector waits for that file (bounded), sends the signal, and writes
``OUT/chaos/release_<tag>`` so a victim that was only a sync point (an etcd
restart, a leader on another node) goes on. Targets are found from those
files, ``/proc`` and the job's etcd records -- never from library internals.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from ckptless.chaos.cluster import Agent, LocalCluster, wait_for
from ckptless.chaos.schedule import Fault, FaultKind
from ckptless.errors import ConfigError

PAUSE_TIMEOUT_S = 180.0  # from job start to the scheduled step, on a loaded 2-core machine


@dataclass(frozen=True)
class Injection:
    """What was done, to whom, when (monotonic: comparable with the goodput ledgers on this host)."""

    fault: Fault
    t_monotonic: float
    pids: tuple[int, ...]
    agents_killed: tuple[int, ...]
    lost: tuple[int, ...]
    note: str


def pause_tag(fault_index: int, rank: int) -> str:
    return f"f{fault_index}r{rank}"


def pause_spec(faults: tuple[Fault, ...]) -> str:
    """``CHAOS_PAUSES`` for the training script: one pause per (fault, target rank)."""
    return ",".join(f"{pause_tag(i, r)}:{r}:{f.step}" for i, f in enumerate(faults) for r in f.targets)


def _chaos_dir(out: Path) -> Path:
    return out / "chaos"


def wait_paused(out: Path, tag: str, timeout_s: float = PAUSE_TIMEOUT_S) -> dict[str, int]:
    marker = _chaos_dir(out) / f"paused_{tag}.json"
    wait_for(marker.exists, timeout_s, f"pause point {tag} ({marker})")
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


def restart_etcd(cluster: LocalCluster) -> None:
    """SIGKILL the etcd server and start it again on the same ports and data dir."""
    if cluster.etcd is None:
        raise ConfigError("fault", FaultKind.RESTART_ETCD.value, "the cluster does not own its etcd server")
    cluster.etcd.kill()
    cluster.etcd.start()


def inject_step(cluster: LocalCluster, indexed: list[tuple[int, Fault]], snapshot_wait_s: float = 120.0) -> list[Injection]:
    """Inject all faults scheduled for one step, concurrently (after every victim is held there).

    With disk snapshots on, a kill waits for one complete snapshot first:
    a fallback to disk needs something on disk to fall back to.
    """
    held = {(i, r): wait_paused(cluster.out, pause_tag(i, r)) for i, f in indexed for r in f.targets}
    if cluster.spec.snapshot_every:
        wait_for(lambda: any(cluster.snapshot_dir.rglob("COMPLETE.json")), snapshot_wait_s, "a complete snapshot")
    done: list[Injection] = []
    try:
        for i, f in indexed:
            pids = tuple(held[(i, r)]["pid"] for r in f.targets)
            done.append(_inject_one(cluster, f, pids))
    finally:
        for i, f in indexed:
            for r in f.targets:
                release(cluster.out, pause_tag(i, r))
    return done


def _inject_one(cluster: LocalCluster, f: Fault, pids: tuple[int, ...]) -> Injection:
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
        kill_agent(agent)
        return Injection(f, t, pids, (agent.index,), lost, note)
    if f.kind is FaultKind.KILL_LEADER:
        agent = cluster.leader()
        lost = cluster.ranks_of(agent)
        t = time.monotonic()
        kill_agent(agent)
        return Injection(f, t, (), (agent.index,), lost, f"SIGKILL leader agent{agent.index}")
    if f.kind is FaultKind.RESTART_ETCD:
        restart_etcd(cluster)
        return Injection(f, t, (), (), (), f"etcd restarted in {time.monotonic() - t:.2f}s")
    raise ConfigError("fault", f.kind, "unknown fault kind")
