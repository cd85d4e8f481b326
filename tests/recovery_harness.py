"""Harness for end-to-end recovery tests: real etcd, real agents, real workers, real signals.

The reference job is tests/scripts/train_ref.py: 4 ranks on 2 agents, K = 1.
Faults are injected at exact steps: the victim announces (a file) that it is
about to run step S and holds there; the test then sends the real signal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ckptless.coordinator.client import EtcdClient
from ckptless.coordinator.config import EtcdConfig
from ckptless.coordinator.keyspace import Keyspace
from ckptless.chaos.scenario import bitwise_diff
from ckptless.mirror.placement import compute_placement
from ckptless.recovery.wire import Membership, membership_from_json

from .conftest import PYTHON, REPO, child_env
from .waiting import wait_json, wait_until

TRAIN = str(REPO / "tests" / "scripts" / "train_ref.py")
STEPS = 10


@dataclass
class Cluster:
    endpoint: str
    out: Path
    job_id: str
    env: dict[str, str] = field(default_factory=dict)
    agents: list[subprocess.Popen[str]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def start_agent(self, *extra: str, nproc: int = 2) -> subprocess.Popen[str]:
        env = child_env()
        env.update({"REF_STEPS": str(STEPS), "CKPTLESS_LOG_LEVEL": "INFO", "CKPTLESS_COLLECTIVE_TIMEOUT": "30",
                    "CKPTLESS_RECOVERY_TIMEOUT": "60"})
        env.update(self.env)
        log = self.out / f"agent{len(self.agents)}.log"
        self.logs.append(log)
        proc = subprocess.Popen(
            [PYTHON, "-m", "ckptless.launcher.main", "--nnodes", "2", "--nproc-per-node", str(nproc),
             "--rdzv-id", self.job_id, "--rdzv-endpoint", self.endpoint, "--lease-ttl", "1", *extra,
             TRAIN, str(self.out)],
            env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        self.agents.append(proc)
        return proc

    def client(self) -> EtcdClient:
        return EtcdClient(EtcdConfig((self.endpoint,)))

    def membership(self) -> Membership | None:
        with self.client() as c:
            kv = c.get(Keyspace(self.job_id).membership)
            return None if kv is None else membership_from_json(kv.value)

    def start_leader_then_others(self, *extra: str) -> None:
        """Agent 0 first, elected before agent 1 starts: agent 0 leads and holds ranks 0-1."""
        self.start_agent(*extra)
        with self.client() as c:
            prefix = Keyspace(self.job_id).election_prefix
            wait_until(lambda: bool(c.get_prefix(prefix)[0]), 120, "a leader")
        self.start_agent(*extra)

    def leader_agent(self) -> subprocess.Popen[str]:
        """The agent whose election key has the lowest create revision (node ids embed agent pids)."""
        with self.client() as c:
            kvs, _ = c.get_prefix(Keyspace(self.job_id).election_prefix)
        node_id = min(kvs, key=lambda kv: kv.create_revision).value.decode()
        for a in self.agents:
            if f"-{a.pid}-" in node_id:
                return a
        raise AssertionError(f"no agent matches leader {node_id}")

    def agent_of_rank(self, rank: int) -> subprocess.Popen[str]:
        m = self.membership()
        assert m is not None
        node = m.worker_of(rank).node_id
        return next(a for a in self.agents if f"-{a.pid}-" in node)

    def paused_pid(self, rank: int, which: str = "", timeout: float = 120) -> int:
        return int(wait_json(self.out / f"paused{which}_rank{rank}.json", timeout)["pid"])

    def wait(self, timeout: float = 240, expect_fail: Sequence[subprocess.Popen[str]] = ()) -> None:
        for a in self.agents:
            try:
                code = a.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill_all()
                raise AssertionError(f"agent {a.pid} did not finish in {timeout}s\n{self.tail()}") from None
            if a not in expect_fail:
                assert code == 0, f"agent {a.pid} exited {code}\n{self.tail()}"

    def kill_all(self) -> None:
        for a in self.agents:
            if a.poll() is None:
                try:
                    os.killpg(a.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                a.wait(10)

    def tail(self, n: int = 4000) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-n:]}" for p in self.logs if p.exists())

    def finals(self, world: int = 4) -> dict[int, dict[str, object]]:
        return {r: torch.load(self.out / f"final_rank{r}.pt", weights_only=True) for r in range(world)}

    def pids(self, rank: int) -> list[dict[str, object]]:
        return [json.loads(line) for line in (self.out / f"pids_rank{rank}.jsonl").read_text().splitlines()]


def ring_holders(world: int = 4, per_node: int = 2) -> dict[int, tuple[int, ...]]:
    node_of = [r // per_node for r in range(world)]
    p = compute_placement(world, 1, "ring", node_of)
    return {r: p.holders(r) for r in range(world)}


def independent_pair() -> tuple[int, int]:
    """Two ranks, neither holding the other's replica (different placement groups)."""
    holders = ring_holders()
    for a in range(4):
        for b in range(a + 1, 4):
            if b not in holders[a] and a not in holders[b]:
                return a, b
    raise AssertionError(f"no independent pair in {holders}")


def assert_bitwise_equal(got: dict[int, dict[str, object]], want: dict[int, dict[str, object]]) -> None:
    """Parameters, optimizer state, LR, RNG draws and data position: torch.equal, no tolerance."""
    problems = bitwise_diff(got, want)
    assert not problems, "differs after recovery: " + "; ".join(problems[:10])


def wait_membership(cluster: Cluster, generation: int, timeout: float = 120) -> Membership:
    found: list[Membership] = []

    def ready() -> bool:
        m = cluster.membership()
        if m is not None and m.generation >= generation:
            found.append(m)
            return True
        return False

    wait_until(ready, timeout, f"membership of generation {generation}", interval_s=0.02)
    return found[-1]
