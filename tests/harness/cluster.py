"""Harness for end-to-end recovery tests: real etcd, real agents, real workers, real signals.

The reference job is tests/harness/scripts/train_ref.py: 4 ranks on 2 agents, K = 1.
Faults are injected at exact steps: the victim announces (a file) that it is
about to run step S and holds there; the test then sends the real signal.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ckptless.coordinator.client import EtcdClient
from ckptless.coordinator.config import EtcdConfig
from ckptless.coordinator.keyspace import Keyspace
from ckptless.chaos.scenario import bitwise_diff
from ckptless.mirror.placement import compute_placement
from ckptless.recovery.view import ExitRecord
from ckptless.recovery.wire import Membership, membership_from_json, spare_from_json

from .repo import PYTHON, SCRIPTS, child_env
from .waiting import wait_json, wait_until

TRAIN = str(SCRIPTS / "train_ref.py")
STEPS = 10

Finals = dict[int, dict[str, object]]


@dataclass
class Cluster:
    endpoint: str
    out: Path
    job_id: str
    env: dict[str, str] = field(default_factory=dict)
    agents: list[subprocess.Popen[str]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    user: str | None = None  # etcd credentials (also given to the agents as CKPTLESS_ETCD_USER/PASSWORD)
    password: str | None = None

    def start_agent(self, *extra: str, nproc: int = 2, nnodes: str = "2", script: str = TRAIN,
                    script_args: Sequence[str] | None = None, single_node: bool = False,
                    env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        """An agent of this job on ``endpoint``; ``single_node``: one agent whose flags in ``extra`` say how
        it coordinates (``--standalone``, ``--rdzv-backend static``): no endpoint, job id or --nnodes given.
        ``env``: this agent's own additions over the job's (its node's ``CUDA_VISIBLE_DEVICES``)."""
        agent_env, env = env or {}, child_env()
        env.update({"REF_STEPS": str(STEPS), "CKPTLESS_LOG_LEVEL": "INFO", "CKPTLESS_COLLECTIVE_TIMEOUT": "30",
                    "CKPTLESS_RECOVERY_TIMEOUT": "60"})
        if self.user is not None and self.password is not None:
            env.update({"CKPTLESS_ETCD_USER": self.user, "CKPTLESS_ETCD_PASSWORD": self.password})
        env.update(self.env)
        env.update(agent_env)
        log = self.out / f"agent{len(self.agents)}.log"
        self.logs.append(log)
        where = ([] if single_node else
                 ["--nnodes", nnodes, "--rdzv-id", self.job_id, "--rdzv-endpoint", self.endpoint, "--lease-ttl", "1"])
        proc = subprocess.Popen(
            [PYTHON, "-m", "ckptless.launcher.main", "--nproc-per-node", str(nproc), *where, *extra,
             script, *(script_args if script_args is not None else (str(self.out),))],
            env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        self.agents.append(proc)
        return proc

    def client(self) -> EtcdClient:
        return EtcdClient(EtcdConfig((self.endpoint,), user=self.user, password=self.password))

    def exit_record(self, rank: int) -> ExitRecord | None:
        with self.client() as c:
            kv = c.get(Keyspace(self.job_id).worker_exit(rank))
            return None if kv is None else ExitRecord.from_json(kv.value)

    def release(self, name: str = "release") -> None:
        """Create OUT/<name>: ends the pauses of a job started with REF_PAUSE_RELEASE=<name>."""
        (self.out / name).write_text("go")

    def log_text(self) -> str:
        return "\n".join(p.read_text(errors="replace") for p in self.logs if p.exists())

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
                live = self.live_processes()
                self.kill_all()
                raise AssertionError(f"agent {a.pid} did not finish in {timeout}s\n{live}\n{self.tail()}") from None
            if a not in expect_fail:
                assert code == 0, f"agent {a.pid} exited {code}\n{self.tail()}"

    def live_processes(self) -> str:
        """Which agents and workers are still alive, and where they wait (for a timeout's message)."""
        lines = []
        for a in self.agents:
            if a.poll() is not None:
                lines.append(f"agent {a.pid}: exited {a.returncode}")
                continue
            lines.append(f"agent {a.pid}: alive ({_proc_state(a.pid)})")
            for pid in descendants(a.pid):
                lines.append(f"  pid {pid}: {_proc_state(pid)}")
        return "\n".join(lines)

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

    def finals(self, world: int = 4) -> Finals:
        return {r: torch.load(self.out / f"final_rank{r}.pt", weights_only=True) for r in range(world)}

    def pids(self, rank: int) -> list[dict[str, object]]:
        return [json.loads(line) for line in (self.out / f"pids_rank{rank}.jsonl").read_text().splitlines()]


def new_cluster(endpoint: str, root: Path, name: str, **env: str) -> Cluster:
    """A job of its own on ``endpoint``: output in ``root/name``, a unique job id, ``env`` for its workers."""
    out = root / name
    out.mkdir()
    return Cluster(endpoint, out, f"{name}-{uuid.uuid4().hex[:6]}", env=dict(env))


def run_fault_free(c: Cluster, agents: int = 2) -> Finals:
    """The reference run every e2e test compares with: ``agents`` agents, no fault, no recovery."""
    try:
        for _ in range(agents):
            c.start_agent()
        c.wait()
    finally:
        c.kill_all()
    finals = c.finals()
    assert all(int(f["recoveries"]) == 0 for f in finals.values())  # type: ignore[call-overload]
    return finals


@dataclass
class FaultFree:
    """A finished fault-free run: its cluster (for its logs) and every rank's final state."""

    cluster: Cluster
    finals: Finals


def fault_free(endpoint: str, root: Path, **env: str) -> FaultFree:
    """The reference job (2 agents x 2 workers, K = 1) run without faults in ``root/baseline``."""
    c = new_cluster(endpoint, root, "baseline", **env)
    return FaultFree(c, run_fault_free(c))


def wait_spare_standing_by(c: Cluster, rank: int, timeout: float = 120) -> None:
    """Until a pre-built spare of ``c``'s job has published that it stands by as ``rank``."""
    with c.client() as cl:
        def standing_by() -> bool:
            kvs, _ = cl.get_prefix(Keyspace(c.job_id).spares_prefix)
            return any(spare_from_json(kv.value).standby_rank == rank for kv in kvs)
        wait_until(standing_by, timeout, f"the spare standing by for rank {rank}")


def kill_when_paused(c: Cluster, rank: int, *flags: str, sig: int = signal.SIGKILL, timeout: float = 240) -> None:
    """Two agents (each given ``flags``); ``sig`` to ``rank`` once it holds at its pause point; the job
    then runs to its end (every agent exits 0 within ``timeout``)."""
    try:
        c.start_agent(*flags)
        c.start_agent(*flags)
        os.kill(c.paused_pid(rank), sig)
        c.wait(timeout)
    finally:
        c.kill_all()


def assert_survivors_kept_pids(c: Cluster, lost: set[int], world: int = 4) -> None:
    """Every ``lost`` rank was replaced; every other rank kept its one process."""
    for r in range(world):
        pids = c.pids(r)
        if r in lost:
            assert len(pids) >= 2, f"rank {r} was lost but never replaced: {pids}"
        else:
            assert len(pids) == 1, f"survivor rank {r} was restarted: {pids}"


def assert_recovered(c: Cluster, want: FaultFree, lost: set[int], world: int = 4) -> None:
    """The run ended bitwise equal to the fault-free one, and only the ``lost`` ranks were replaced."""
    assert_bitwise_equal(c.finals(), want.finals)
    assert_survivors_kept_pids(c, lost, world)


def ring_holders(world: int = 4, per_node: int = 2, replicas: int = 1) -> dict[int, tuple[int, ...]]:
    node_of = [r // per_node for r in range(world)]
    p = compute_placement(world, replicas, "ring", node_of)
    return {r: p.holders(r) for r in range(world)}


def wait_exit(proc: subprocess.Popen[str], timeout: float, what: str = "") -> int:
    """The exit code of ``proc`` once it ends (deadline-bounded; killed and failed past it)."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(10)
        raise AssertionError(f"{what or f'process {proc.pid}'} did not exit within {timeout}s") from None


def flip_byte(path: Path, offset: int | None = None, xor: int = 0xFF) -> None:
    """Change one byte in place: same inode, same size (a silent corruption)."""
    size = path.stat().st_size
    at = size // 2 if offset is None else offset
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ xor]))
    assert path.stat().st_size == size


def _proc_state(pid: int) -> str:
    """State, kernel wait channel and role of a process, from /proc (best effort)."""
    try:
        state = next(line.split(":", 1)[1].strip() for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                     if line.startswith("State:"))
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except (OSError, StopIteration):
        return "gone"
    tags = [kv.decode(errors="replace") for kv in env if kv.startswith((b"RANK=", b"CKPTLESS_ROLE=", b"CKPTLESS_WORKER_ID="))]
    return f"{state}, wchan {wchan or '-'}, {' '.join(tags)}"


def descendants(root_pid: int) -> list[int]:
    """Live descendants of ``root_pid`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    found, todo = [], list(children.get(root_pid, []))
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def descendants_with_env(root_pid: int, key: str, value: str) -> list[int]:
    """Live descendants of ``root_pid`` whose environment has ``key=value`` (Linux /proc)."""
    want = f"{key}={value}".encode()
    found = []
    for pid in descendants(root_pid):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if want in env:
            found.append(pid)
    return found


def independent_pair() -> tuple[int, int]:
    """Two ranks, neither holding the other's replica (different placement groups)."""
    holders = ring_holders()
    for a in range(4):
        for b in range(a + 1, 4):
            if b not in holders[a] and a not in holders[b]:
                return a, b
    raise AssertionError(f"no independent pair in {holders}")


def assert_bitwise_equal(got: Finals, want: Finals) -> None:
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


def _events(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def left_after_incident(goodput: Path, survivors: set[int]) -> dict[int, float]:
    """Seconds from the leader's incident to each survivor leaving generation 0 (wall clocks, one host),
    from the job's goodput ledgers."""
    opened = [e for e in _events(goodput / "leader.jsonl") if e["kind"] == "incident_opened"]
    assert opened, "the leader opened no incident"
    t0 = float(opened[0]["t_wall"])  # type: ignore[arg-type]
    out = {}
    for r in survivors:
        left = [e for e in _events(goodput / f"rank{r}.jsonl")
                if e["kind"] == "failure_detected" and e["generation"] == 0]
        assert left, f"survivor rank {r} never left generation 0"
        out[r] = float(left[0]["t_wall"]) - t0  # type: ignore[arg-type]
    return out


def reformed_after(goodput: Path, ranks: set[int], generation: int, t_wall: float) -> dict[int, float]:
    """Seconds from ``t_wall`` (a wall time, one host) to each rank's ``groups_reformed`` of ``generation``."""
    out = {}
    for r in ranks:
        done = [e for e in _events(goodput / f"rank{r}.jsonl")
                if e["kind"] == "groups_reformed" and e["generation"] == generation]
        assert done, f"rank {r} never formed generation {generation}"
        out[r] = float(done[0]["t_wall"]) - t_wall  # type: ignore[arg-type]
    return out

