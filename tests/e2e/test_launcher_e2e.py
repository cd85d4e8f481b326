"""ckptless-run end to end: real agents, real etcd, real workers, real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from ckptless.coordinator.client import EtcdClient, WatchEvent
from ckptless.coordinator.config import EtcdConfig
from ckptless.coordinator.embedded import EmbeddedEtcd, free_port
from ckptless.coordinator.keyspace import Keyspace

from ..harness.repo import PYTHON, SCRIPTS, child_env
from ..harness.waiting import wait_json, wait_until

RUN = [PYTHON, "-m", "ckptless.launcher.main"]
TORCHRUN_ONLY = {
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS",
    "TORCHELASTIC_ERROR_FILE", "PYTHONUNBUFFERED",
}
VARIES = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", "MASTER_ADDR"}
# The one value ckptless gives on purpose unlike torchrun (1: tear the process down): 2 aborts the
# communicator and keeps the process, whose replicas a recovery needs (ckptless/worker/abort.py).
DIFFERS = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": ("1", "2")}


def _agent(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*RUN, *args], env=env or child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )


def _finish(proc: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.returncode, err


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _env_dump(cmd: list[str], out: Path) -> dict[int, dict[str, str]]:
    out.mkdir()
    res = subprocess.run([*cmd, str(SCRIPTS / "dump_env.py"), str(out)], env=child_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return {r: json.loads((out / f"env_rank{r}.json").read_text()) for r in range(2)}


def test_same_worker_env_as_torchrun(tmp_path: Path) -> None:
    theirs = _env_dump([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"], tmp_path / "torchrun")
    ours = _env_dump([*RUN, "--standalone", "--nproc-per-node", "2"], tmp_path / "ckptless")
    for rank in range(2):
        t_names = {k for k in theirs[rank] if k in TORCHRUN_ONLY or k.startswith(("TORCHELASTIC_", "ROLE_", "GROUP_"))}
        o_names = {k for k in ours[rank] if k in TORCHRUN_ONLY or k.startswith(("TORCHELASTIC_", "ROLE_", "GROUP_"))}
        assert t_names == o_names, f"rank {rank}: only torchrun {t_names - o_names}, only ckptless {o_names - t_names}"
        for name, (torchrun_value, ckptless_value) in DIFFERS.items():
            assert (theirs[rank][name], ours[rank][name]) == (torchrun_value, ckptless_value), name
        for name in sorted(t_names - VARIES - DIFFERS.keys()):
            assert ours[rank][name] == theirs[rank][name], f"rank {rank} {name}: {ours[rank][name]!r} != {theirs[rank][name]!r}"
        assert any(k.startswith("CKPTLESS_") for k in ours[rank])


def test_unported_script_is_told_it_runs_unprotected() -> None:
    """A torchrun script that never calls ckptless.init() trains, exits 0, and is told it ran unprotected."""
    env = child_env()
    res = subprocess.run([*RUN, "--standalone", "--nproc-per-node", "2", str(SCRIPTS / "unported.py")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "no worker of this node called ckptless.init()" in res.stderr
    assert "runs unprotected" in res.stderr


def test_two_agents_form_one_job_on_external_etcd(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-id", "two-nodes", "--rdzv-endpoint", etcd.endpoint]
    agents = [_agent(*common, str(SCRIPTS / "hold_worker.py"), str(tmp_path)) for _ in range(2)]
    try:
        ready = {r: wait_json(tmp_path / f"ready_rank{r}.json", 90) for r in range(4)}
        assert {int(d["WORLD_SIZE"]) for d in ready.values()} == {4}
        assert sorted(int(d["RANK"]) for d in ready.values()) == [0, 1, 2, 3]
        assert {int(d["GROUP_RANK"]) for d in ready.values()} == {0, 1}
        assert len({(d["MASTER_ADDR"], d["MASTER_PORT"]) for d in ready.values()}) == 1
        (tmp_path / "release").write_text("go")
        for a in agents:
            code, err = _finish(a, 120)
            assert code == 0, err
        # One job: the all_reduce spanned all four ranks (1+2+3+4).
        assert {(tmp_path / f"sum_rank{r}").read_text() for r in range(4)} == {"10"}
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
    with EtcdClient(EtcdConfig((etcd.endpoint,))) as c:
        nodes, _ = c.get_prefix(Keyspace("two-nodes").nodes_prefix)
        assert nodes == [], "a clean exit must leave no node key behind"


@pytest.mark.rotating(3)  # CI budget: tests/harness/rotation.py
def test_worker_kill_recorded_and_agent_kill_detected(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    ks = Keyspace("kills")
    client = EtcdClient(EtcdConfig((etcd.endpoint,)))
    seen: dict[str, float] = {}
    got = threading.Event()

    def on_events(events: list[WatchEvent]) -> None:
        for e in events:
            seen.setdefault(f"{e.kind}:{e.key}", time.monotonic())
        got.set()

    watch = client.watch_prefix(ks.prefix, on_events)
    agent = _agent(
        "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-id", "kills", "--rdzv-endpoint", etcd.endpoint,
        "--lease-ttl", "1", str(SCRIPTS / "hold_worker.py"), str(tmp_path),
    )
    try:
        ready = {r: wait_json(tmp_path / f"ready_rank{r}.json", 90) for r in range(2)}
        killed = time.monotonic()
        os.kill(int(ready[1]["pid"]), signal.SIGKILL)
        wait_until(lambda: f"put:{ks.worker_exit(1)}" in seen, 5, "exit record of rank 1")
        latency = seen[f"put:{ks.worker_exit(1)}"] - killed
        kv = client.get(ks.worker_exit(1))
        assert kv is not None
        record = json.loads(kv.value)
        assert record["signal"] == signal.SIGKILL and record["rank"] == 1
        print(f"exit record visible to a watcher {latency * 1000:.1f} ms after SIGKILL")
        assert latency < 0.1
        # The agent stops the surviving worker and exits non-zero, leaving no orphan.
        code, _ = _finish(agent, 60)
        assert code != 0
        assert not _alive(int(ready[0]["pid"]))
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)

    # Now a whole agent is SIGKILLed: its node key vanishes within TTL + 0.5 s.
    out2 = tmp_path / "second"
    out2.mkdir()
    agent = _agent(
        "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-id", "kills2", "--rdzv-endpoint", etcd.endpoint,
        "--lease-ttl", "1", str(SCRIPTS / "hold_worker.py"), str(out2),
    )
    ks2 = Keyspace("kills2")
    watch2 = client.watch_prefix(ks2.nodes_prefix, on_events)
    try:
        worker = wait_json(out2 / "ready_rank0.json", 90)
        nodes, _ = client.get_prefix(ks2.nodes_prefix)
        assert len(nodes) == 1
        killed = time.monotonic()
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(10)
        key = f"delete:{nodes[0].key}"
        wait_until(lambda: key in seen, 3, "node key deletion")
        print(f"node key deleted {seen[key] - killed:.3f}s after the agent's SIGKILL (ttl 1s)")
        assert seen[key] - killed <= 1.5
        wait_until(lambda: not _alive(int(worker["pid"])), 5, "worker death after its agent's SIGKILL")
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
        watch.cancel()
        watch2.cancel()
        client.close()


def test_sigterm_is_forwarded_and_nothing_is_left(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    agent = _agent(
        "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-id", "term", "--rdzv-endpoint", etcd.endpoint,
        str(SCRIPTS / "hold_worker.py"), str(tmp_path),
    )
    ready = {r: wait_json(tmp_path / f"ready_rank{r}.json", 90) for r in range(2)}
    agent.send_signal(signal.SIGTERM)
    code, err = _finish(agent, 60)
    assert code == 128 + signal.SIGTERM, err[-4000:]
    for r in range(2):
        assert not _alive(int(ready[r]["pid"]))
    with EtcdClient(EtcdConfig((etcd.endpoint,))) as c:
        kvs, _ = c.get_prefix(Keyspace("term").nodes_prefix)
        assert kvs == []
        exits, _ = c.get_prefix(Keyspace("term").exits_prefix)
        assert {json.loads(kv.value)["signal"] for kv in exits} == {signal.SIGTERM}


@pytest.mark.rotating(1)  # CI budget: tests/harness/rotation.py
def test_agent_survives_etcd_restart(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    ks = Keyspace("restart")
    agent = _agent(
        "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-id", "restart", "--rdzv-endpoint", etcd.endpoint,
        "--lease-ttl", "2", str(SCRIPTS / "hold_worker.py"), str(tmp_path),
    )
    try:
        ready = {r: wait_json(tmp_path / f"ready_rank{r}.json", 90) for r in range(2)}
        etcd.kill()
        etcd.start()
        with EtcdClient(EtcdConfig((etcd.endpoint,))) as c:
            # Still registered after the restart (lease kept alive across it) ...
            wait_until(lambda: len(c.get_prefix(ks.nodes_prefix)[0]) == 1, 10, "node key after restart")
            # ... and the agent writes through the reconnected client.
            os.kill(int(ready[1]["pid"]), signal.SIGKILL)
            wait_until(lambda: c.get(ks.worker_exit(1)) is not None, 15, "exit record after restart")
        code, _ = _finish(agent, 60)
        assert code != 0
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--no-such-flag", "x.py"], "unrecognized arguments"),
        (["--nnodes", "3:1", "x.py"], "nnodes"),
        (["--nnodes", "two", "x.py"], "nnodes"),
        (["--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "x", "x.py"], "unreachable"),
        # combinations that can never work are refused at start, not after a 15-minute wait
        (["--standalone", "--nproc-per-node", "0", "--spares", "1", "x.py"], "spare-only node"),
        (["--nproc-per-node", "0", "--spares", "1", "x.py"], "spare-only node"),
        (["--nproc-per-node", "2", "--replicas", "2", "x.py"], "replicas"),
        (["--nproc-per-node", "4", "--replicas", "4", "--standalone", "x.py"], "world size (4)"),
    ],
)
def test_bad_input_is_one_clear_line(args: list[str], needle: str) -> None:
    env = child_env()
    res = subprocess.run([*RUN, *args], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert "Traceback" not in res.stderr
    assert needle in lines[-1], res.stderr


def test_spares_get_a_gpu_of_their_own_or_the_start_is_refused(tmp_path: Path) -> None:
    """No GPU here: the node's GPUs are declared (CKPTLESS_NODE_GPUS, or the agent's CUDA_VISIBLE_DEVICES).
    Members keep torchrun's GPU = local rank; each spare gets a free GPU as a valid ordinal (plain) or
    as its one visible device (--virtual-local-rank); one spare too many is one line, exit 2."""
    base = {k: v for k, v in child_env().items() if k not in ("CUDA_VISIBLE_DEVICES", "CKPTLESS_NODE_GPUS")}
    refused = subprocess.run([*RUN, "--standalone", "--nproc-per-node", "2", "--spares", "3", "x.py"],
                             env=dict(base, CKPTLESS_NODE_GPUS="4"), capture_output=True, text=True, timeout=60)
    lines = [ln for ln in refused.stderr.splitlines() if ln.strip()]
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert "--spares 3" in lines[0] and "has 4 (CKPTLESS_NODE_GPUS)" in lines[0] and "--nproc-per-node 0" in lines[0]
    runs = {"plain": ({"CKPTLESS_NODE_GPUS": "4"}, [], {"w0": ("0", None), "w1": ("1", None),
                                                        "spare0": ("2", None), "spare1": ("3", None)}),
            "virtual": ({"CUDA_VISIBLE_DEVICES": "4,5,6,7"}, ["--virtual-local-rank"],
                        {"w0": ("0", "4"), "w1": ("0", "5"), "spare0": ("0", "6"), "spare1": ("0", "7")})}
    for name, (env, flags, expected) in runs.items():
        out = tmp_path / name
        out.mkdir()
        res = subprocess.run([*RUN, "--standalone", "--nproc-per-node", "2", "--spares", "2", *flags,
                              str(SCRIPTS / "dump_env.py"), str(out), "--by-worker", "--wait-for", "4"],
                             env=dict(base, **env), capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr[-3000:]
        seen = {}
        for worker in expected:
            d = json.loads((out / f"env_{worker}.json").read_text())
            seen[worker] = (d["LOCAL_RANK"], d.get("CUDA_VISIBLE_DEVICES"))
        assert seen == expected, name


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_waiting_agent_obeys_signals_within_two_seconds(etcd: EmbeddedEtcd, tmp_path: Path, sig: int) -> None:
    """An agent waiting for a node that never comes (rendezvous) or for its job to start (a spare-only
    node) stops within 2 s of SIGINT/SIGTERM, with the shell's exit code and no traceback."""
    waiting = [
        _agent("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-id", f"alone-{sig}", "--rdzv-endpoint",
               etcd.endpoint, str(SCRIPTS / "hold_worker.py"), str(tmp_path)),
        _agent("--nproc-per-node", "0", "--spares", "1", "--rdzv-id", f"nojob-{sig}", "--rdzv-endpoint",
               etcd.endpoint, str(SCRIPTS / "hold_worker.py"), str(tmp_path)),
    ]
    with EtcdClient(EtcdConfig((etcd.endpoint,))) as c:
        for job in (f"alone-{sig}", f"nojob-{sig}"):  # both registered: they are waiting now
            wait_until(lambda job=job: bool(c.get_prefix(Keyspace(job).nodes_prefix)[0]), 60, f"{job} waiting")
    for a in waiting:
        t0 = time.monotonic()
        a.send_signal(sig)
        code, err = _finish(a, 10)
        took = time.monotonic() - t0
        assert took < 2.0, f"took {took:.2f}s to obey {signal.Signals(sig).name}"
        assert code == 128 + sig, (code, err)
        assert "Traceback" not in err, err
