"""A local ckptless job under test: an etcd, N ``ckptless-run`` agents, an output dir.

Why the cluster owns its etcd by default: the chaos runner must observe the
job (leader, generation) and restart the coordinator's server, which it can
only do on a server it started. Observation goes through the public
``ckptless.coordinator`` client and keyspace only; everything else is learnt
from real processes (``/proc``) and the files the job writes.

Every agent runs in its own session (process group) so cleanup can reach its
workers even when the agent itself is gone; logs go to files, never to the
runner's terminal.

With ``ClusterSpec(netns=True)`` every agent (a "node") runs in its own network
namespace (:mod:`ckptless.chaos.netns`), etcd listens on the bridge address in
the root namespace, and each agent gets ``--local-addr <its address>`` (its
TCPStore binds and is advertised there) and ``GLOO_SOCKET_IFNAME`` (its
workers' Gloo devices bind the namespace's interface, not the loopback the
hostname resolves to). That is what partitions are injected into.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ckptless import environment
from ckptless.chaos.netns import NS_IF, NetTopology, NodeNet
from ckptless.chaos.proctable import alive, parent_pid, proc_state
from ckptless.coordinator import EtcdClient
from ckptless.coordinator import EtcdConfig
from ckptless.coordinator import EmbeddedEtcd
from ckptless.coordinator import Keyspace
from ckptless.errors import CkptlessError, ConfigError, CoordinatorError
from ckptless.recovery import membership_from_json

REPO = Path(__file__).resolve().parent.parent
DEMO_SCRIPT = REPO / "examples" / "train_demo.py"
# Every process of a job started here carries this variable (value: the run's output dir), so
# leftovers are found even when the script's command line does not name the output dir.
RUN_MARK = "CHAOS_RUN"


class ChaosTimeout(CkptlessError):
    """A bounded wait of the chaos runner ran past its deadline."""


class AgentExited(CkptlessError):
    """An agent of the chaos cluster ended before the job it was to run started (its log says why)."""


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.01) -> float:
    """Poll ``cond`` until true (a condition, never a guess at timing); return the time taken."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout_s:
            raise ChaosTimeout(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)
    return time.monotonic() - start


@dataclass(frozen=True)
class ClusterSpec:
    """Shape of the local job. ``spare_nodes`` agents run only warm spares (``--nproc-per-node 0``)."""

    nodes: int = 2
    nproc_per_node: int = 2
    spares_per_node: int = 0
    spare_nodes: int = 0
    spares_per_spare_node: int = 2
    spare_node_args: tuple[str, ...] = ()  # extra ckptless-run flags of the spare-only agents
    agent_args: tuple[str, ...] = ()  # extra ckptless-run flags of every agent
    hang_timeout: float | None = None
    snapshot_every: int = 0
    lease_ttl: float = 1.0
    node_grace: float | None = None  # --node-grace (None: the launcher's default, 10 s)
    netns: bool = False  # one network namespace per agent (partitions need it; root, ip, nft)
    steps: int = 12
    width: int = 32
    script: Path = DEMO_SCRIPT
    env: Mapping[str, str] = field(default_factory=dict)
    # The script's arguments; ``{out}`` in one is replaced by the run's output dir. None: the
    # demo/matrix convention -- the output dir alone, plus DEMO_STEPS/DEMO_WIDTH from steps/width.
    script_args: tuple[str, ...] | None = None

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    def validate(self) -> None:
        for name in ("nodes", "nproc_per_node", "steps", "width"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ConfigError(name, v, "must be an int >= 1")
        for name in ("spares_per_node", "spare_nodes", "spares_per_spare_node", "snapshot_every"):
            v = getattr(self, name)
            if type(v) is not int or v < 0:
                raise ConfigError(name, v, "must be an int >= 0")
        if self.hang_timeout is not None and self.hang_timeout <= 0:
            raise ConfigError("hang_timeout", self.hang_timeout, "must be > 0 seconds")
        if self.lease_ttl < 1:
            raise ConfigError("lease_ttl", self.lease_ttl, "must be >= 1 second")
        if self.node_grace is not None and self.node_grace <= 0:
            raise ConfigError("node_grace", self.node_grace, "must be > 0 seconds")


@dataclass
class Agent:
    index: int
    proc: subprocess.Popen[bytes]
    log: Path
    spare_only: bool

    @property
    def pid(self) -> int:
        return self.proc.pid


def child_env(extra: Mapping[str, str]) -> dict[str, str]:
    """The agents' environment: quiet gRPC, one thread per worker (2 cores), importable repo.

    The collective/recovery timeouts are generous: a respawned worker is a cold
    process (``import torch``), which on a loaded 2-core machine took > 30 s and
    turned a clean recovery into a "failure during recovery" cascade.
    """
    env = dict(environment.environ())
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update({"GRPC_ENABLE_FORK_SUPPORT": "false", "GRPC_VERBOSITY": "ERROR", "OMP_NUM_THREADS": "1",
                "CKPTLESS_LOG_LEVEL": "INFO", "CKPTLESS_COLLECTIVE_TIMEOUT": "90",
                "CKPTLESS_RECOVERY_TIMEOUT": "180"})
    # Its agents are "nodes" on one host: each would count every GPU of the host as its own and refuse
    # more workers + spares than that. A local cluster gives out no GPUs unless told (launcher/devices.py).
    env.setdefault("CKPTLESS_NODE_GPUS", "0")
    env.update(extra)
    return env


class LocalCluster:
    """Start, observe and tear down one job. Use as a context manager: teardown is in ``__exit__``."""

    def __init__(self, spec: ClusterSpec, out: Path, name: str, etcd_endpoint: str | None = None,
                 pauses: str = "", points: str = "", digest: bool = False) -> None:
        spec.validate()
        self.spec = spec
        self.out = out
        self.job_id = f"{name}-{uuid.uuid4().hex[:6]}"
        self.keyspace = Keyspace(self.job_id)
        self.agents: list[Agent] = []
        self.etcd: EmbeddedEtcd | None = None
        self._endpoint = etcd_endpoint
        self._pauses = pauses  # the demo script's own CHAOS_PAUSES (tag:rank:step)
        self._points = points  # the library's CKPTLESS_CHAOS_POINTS (tag=step:r<R>:<S>), any script
        self._digest = digest  # ask every rank for its library digest at close() (CKPTLESS_DIGEST_DIR)
        self._client: EtcdClient | None = None
        self.net: NetTopology | None = None
        self._timers: list[threading.Timer] = []
        if spec.netns and etcd_endpoint is not None:
            raise ConfigError("etcd_endpoint", etcd_endpoint, "a netns cluster starts its own etcd on its bridge")
        out.mkdir(parents=True, exist_ok=True)
        (out / "logs").mkdir(exist_ok=True)

    # --- lifecycle ------------------------------------------------------------------
    @property
    def endpoint(self) -> str:
        assert self._endpoint is not None, "cluster not started"
        return self._endpoint

    @property
    def goodput_dir(self) -> Path:
        return self.out / "goodput"

    @property
    def snapshot_dir(self) -> Path:
        return self.out / "snapshots"

    @property
    def digest_dir(self) -> Path:
        """Where every rank's library digest lands at ``job.close()`` (``CKPTLESS_DIGEST_DIR``)."""
        return self.out / "digest"

    def script_args(self) -> list[str]:
        if self.spec.script_args is None:
            return [str(self.out)]
        return [a.replace("{out}", str(self.out)) for a in self.spec.script_args]

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """etcd (unless given), then the node-rank-0 agent, elected before the others start.

        Starting agent 0 alone until it leads makes the layout deterministic:
        agent 0 leads and holds ranks 0..nproc-1, agent i holds the next block.
        """
        host = "127.0.0.1"
        if self.spec.netns:
            self.net = NetTopology(self.job_id, self.spec.nodes + self.spec.spare_nodes).create()
            host = self.net.root_ip
            (self.out / "logs" / "netns.json").write_text(json.dumps(
                {"bridge": self.net.bridge, "root_ip": host,
                 "nodes": [{"ns": n.ns, "ip": n.ip, "host_if": n.host_if} for n in self.net.nodes]}, indent=1))
        if self._endpoint is None:
            self.etcd = EmbeddedEtcd(data_dir=self.out / "etcd", log_path=self.out / "logs" / "etcd.log",
                                     host=host).start()
            self._endpoint = self.etcd.endpoint
        first = self._start_agent(self.spec.nproc_per_node, self.spec.spares_per_node)

        def leader_or_exit() -> bool:
            """A leader is elected, or the first agent already exited (a config error): say so at once."""
            if first.proc.poll() is not None:
                tail = first.log.read_text(errors="replace")[-2000:] if first.log.exists() else ""
                raise AgentExited(f"agent 0 exited {first.proc.returncode} before a leader was elected:\n{tail}")
            return bool(self.client().get_prefix(self.keyspace.election_prefix)[0])

        wait_for(leader_or_exit, 120, "a leader")
        for _ in range(self.spec.nodes - 1):
            self._start_agent(self.spec.nproc_per_node, self.spec.spares_per_node)
        for _ in range(self.spec.spare_nodes):
            self._start_agent(0, self.spec.spares_per_spare_node, self.spec.spare_node_args)

    def _workdir(self) -> Path:
        """This run's own working directory: a link to every entry of the caller's, made once.

        Why: the fault-free run and the faulty run must not share files a script writes where it
        runs (the DDP tutorial writes ``snapshot.pt`` and resumes from it when it exists: the
        faulty run resumed from the fault-free run's). Reading relative paths still works
        through the links; what a run creates stays in its own directory."""
        work = self.out / "work"
        if not work.exists():
            work.mkdir(parents=True)
            here = Path.cwd()
            for entry in here.iterdir():
                try:
                    (work / entry.name).symlink_to(entry)
                except OSError:
                    pass  # a name we cannot link: that path is simply not there for the script
        return work

    def _start_agent(self, nproc: int, spares: int, extra_args: tuple[str, ...] = ()) -> Agent:
        s = self.spec
        args = ["--nnodes", str(s.nodes), "--nproc-per-node", str(nproc), "--rdzv-id", self.job_id,
                "--rdzv-endpoint", self.endpoint, "--lease-ttl", str(s.lease_ttl),
                "--goodput-dir", str(self.goodput_dir), *s.agent_args, *extra_args]
        if spares:
            args += ["--spares", str(spares)]
        if s.hang_timeout:
            args += ["--hang-timeout", str(s.hang_timeout)]
        if s.snapshot_every:
            args += ["--snapshot-every", str(s.snapshot_every), "--snapshot-dir", str(self.snapshot_dir)]
        if s.node_grace is not None:
            args += ["--node-grace", str(s.node_grace)]
        extra = {"DEMO_STEPS": str(s.steps), "DEMO_WIDTH": str(s.width)} if s.script_args is None else {}
        extra.update({"CHAOS_PAUSES": self._pauses, RUN_MARK: str(self.out)})
        if self._digest:
            extra["CKPTLESS_DIGEST_DIR"] = str(self.digest_dir)
        if self._points:
            extra.update({"CKPTLESS_CHAOS_DIR": str(self.out / "chaos"), "CKPTLESS_CHAOS_POINTS": self._points})
        env = child_env({**extra, **s.env})
        prefix: list[str] = []
        if self.net is not None:
            node = self.net.nodes[len(self.agents)]
            prefix = node.exec_prefix()  # `ip netns exec` execs: the Popen pid is the agent's
            args += ["--local-addr", node.ip]
            env["GLOO_SOCKET_IFNAME"] = NS_IF
        log = self.out / "logs" / f"agent{len(self.agents)}.log"
        with open(log, "wb") as f:
            proc = subprocess.Popen([*prefix, sys.executable, "-m", "ckptless.launcher.main", *args,
                                     str(Path(s.script).resolve()), *self.script_args()], env=env, stdout=f,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                    cwd=self._workdir())
        agent = Agent(len(self.agents), proc, log, spare_only=nproc == 0)
        self.agents.append(agent)
        return agent

    def wait(self, timeout_s: float) -> dict[int, int | None]:
        """Exit code per agent index (None: still running at the deadline, then killed)."""
        deadline = time.monotonic() + timeout_s
        codes: dict[int, int | None] = {}
        for a in self.agents:
            try:
                codes[a.index] = a.proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                codes[a.index] = None
        return codes

    def kill_all(self) -> None:
        for a in self.agents:
            try:
                os.killpg(a.pid, signal.SIGKILL)  # the agent's session: it and its workers
            except (ProcessLookupError, PermissionError):
                pass
            try:
                a.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for pid in self.job_processes():
            try:
                os.kill(pid, signal.SIGKILL)  # workers of a killed agent live in its old session
            except ProcessLookupError:
                pass

    def add_timer(self, timer: threading.Timer) -> None:
        """A delayed action of an injector (a heal); cancelled at teardown."""
        self._timers.append(timer)

    def note(self, what: str) -> None:
        """One timestamped line in ``logs/chaos.log`` (monotonic: comparable with the ledgers)."""
        wall = time.time()
        stamp = time.strftime("%H:%M:%S", time.localtime(wall)) + f".{int(wall * 1000) % 1000:03d}"
        with open(self.out / "logs" / "chaos.log", "a") as f:
            f.write(f"{time.monotonic():.3f} {stamp} {what}\n")

    def close(self) -> None:
        for timer in self._timers:
            timer.cancel()
        try:
            self.kill_all()
        finally:
            try:
                if self._client is not None:
                    self._client.close()
                    self._client = None
                if self.etcd is not None:
                    self.etcd.stop()
            finally:
                if self.net is not None:
                    self.net.close()

    def node_net(self, agent: Agent) -> NodeNet:
        """The network namespace agent ``agent`` runs in (netns clusters only)."""
        if self.net is None:
            raise ConfigError("netns", False, "this cluster runs without network namespaces")
        return self.net.nodes[agent.index]

    def etcd_port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    # --- observation ----------------------------------------------------------------
    def client(self) -> EtcdClient:
        if self._client is None:
            self._client = EtcdClient(EtcdConfig((self.endpoint,)))
        return self._client

    def generation(self) -> int | None:
        """The fenced generation counter (``generation`` key), or None before the job wrote it."""
        kv = self.client().get(self.keyspace.generation)
        return None if kv is None else int(json.loads(kv.value)["generation"])

    def leader_node_id(self) -> str:
        """The contender with the lowest create revision under ``election/`` leads."""
        kvs, _ = self.client().get_prefix(self.keyspace.election_prefix)
        if not kvs:
            raise CoordinatorError(f"job {self.job_id}: no election contender")
        return min(kvs, key=lambda kv: kv.create_revision).value.decode()

    def agent_by_node_id(self, node_id: str) -> Agent:
        """Node ids are ``<host>-<agent pid>-<hex>``."""
        for a in self.agents:
            if f"-{a.pid}-" in node_id:
                return a
        raise CoordinatorError(f"no agent of this cluster has node id {node_id}")

    def leader(self) -> Agent:
        return self.agent_by_node_id(self.leader_node_id())

    def agent_of_pid(self, worker_pid: int) -> Agent:
        """A worker's agent is its parent process (agents spawn workers directly; a warm respawn
        is re-parented to its agent), else the nearest agent up the parent chain."""
        by_pid = {a.pid: a for a in self.agents}
        pid, seen = worker_pid, 0
        while seen < 16:
            ppid = parent_pid(pid)
            if ppid in by_pid:
                return by_pid[ppid]
            if ppid <= 1:
                break
            pid, seen = ppid, seen + 1
        raise CoordinatorError(f"worker {worker_pid} has parent {parent_pid(worker_pid)}, not one of our agents")

    def ranks_of(self, agent: Agent) -> tuple[int, ...]:
        """Ranks whose current worker (last line of ``pids_rank<R>.jsonl``) is a child of ``agent``;
        for a script that writes no such files, the ranks the job's ``membership`` record puts on
        ``agent``'s node."""
        found = []
        recorded = False
        for r in range(self.spec.world_size):
            recs = self.pids(r)
            recorded = recorded or bool(recs)
            if recs and parent_pid(int(str(recs[-1]["pid"]))) == agent.pid:
                found.append(r)
        if recorded:
            return tuple(found)
        kv = self.client().get(self.keyspace.membership)
        if kv is None:
            return ()
        return tuple(sorted(a.rank for a in membership_from_json(kv.value).ranks if f"-{agent.pid}-" in a.node_id))

    def job_processes(self) -> list[int]:
        """Live (non-zombie) processes of this job (:func:`job_processes_of` its output dir)."""
        return job_processes_of(self.out)

    def pids(self, rank: int) -> list[dict[str, object]]:
        path = self.out / f"pids_rank{rank}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def tail(self, chars: int = 3000) -> str:
        return "\n".join(f"--- {a.log.name}\n{a.log.read_text(errors='replace')[-chars:]}"
                         for a in self.agents if a.log.exists())

    def logs_text(self) -> str:
        return "\n".join(a.log.read_text(errors="replace") for a in self.agents if a.log.exists())


def job_processes_of(out: Path) -> list[int]:
    """Live (non-zombie) processes of the run writing to ``out``: their command line names it, or
    their environment carries ``RUN_MARK`` for it (any script, whatever its arguments)."""
    needle = str(out).encode() + b"\0"  # the script's argument, exactly
    mark = b"\0" + f"{RUN_MARK}={out}".encode() + b"\0"
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
            hit = needle in cmd
            if not hit:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    hit = mark in b"\0" + f.read()
            if hit and proc_state(int(entry)) not in ("Z", "X"):
                found.append(int(entry))
        except OSError:
            continue
    return found


def wait_gone(pids: Sequence[int], timeout_s: float) -> list[int]:
    """Wait (bounded) for processes to exit; return those still alive at the deadline."""
    try:
        wait_for(lambda: not any(alive(p) for p in pids), timeout_s, "processes to exit")
    except ChaosTimeout:
        pass
    return [p for p in pids if alive(p)]
