"""Who may take part in a job (issue 35, findings 3 and 6): an agent after the job's end, and agents
that disagree on a flag that must agree.

Real etcd, real agents and workers. Finding 3: a node lost with no spare, the job ends at
``--replacement-timeout``; a new agent started with the same ``--rdzv-id`` afterwards waited for a
round that never closed (still running after 161 s). Now an agent whose job has ended exits at once
with one line giving the outcome (1 for a failed job, 0 for a finished one), and writes nothing of
the job's. Finding 6: two agents of one job with other ``--replicas`` (or other script arguments)
formed the job and hung or failed minutes later. Now the later one is refused at the rendezvous in
seconds with one line naming the flag and both values, before any worker runs.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from ckptless.coordinator.embedded import EmbeddedEtcd
from ckptless.coordinator.keyspace import Keyspace
from ckptless.coordinator.rendezvous import RoundState

from ..harness.cluster import Cluster, new_cluster, wait_exit
from ..harness.waiting import wait_until

PROMPT_S = 15.0  # an agent's start (python, torch's import) and one look at etcd, on 2 busy cores


def _records(c: Cluster) -> dict[str, tuple[bytes, int]]:
    """Every key of the job with its value and the revision that last changed it."""
    with c.client() as client:
        kvs, _ = client.get_prefix(Keyspace(c.job_id).prefix)
    return {kv.key: (kv.value, kv.mod_revision) for kv in kvs}


def _pids(c: Cluster) -> dict[str, str]:
    """Every rank's record of the processes that ran it."""
    return {p.name: p.read_text() for p in c.out.glob("pids_rank*")}


def _late_agent(c: Cluster, *extra: str, **kw: object) -> tuple[int, float, str]:
    """A new agent of ``c``'s job: its exit code, how long it ran, its log."""
    t0 = time.monotonic()
    proc = c.start_agent(*extra, **kw)  # type: ignore[arg-type]
    code = wait_exit(proc, PROMPT_S * 2, "the agent started after the job's end")
    return code, time.monotonic() - t0, c.logs[c.agents.index(proc)].read_text(errors="replace")


def test_an_agent_after_the_job_failed_exits_1_at_once_naming_the_outcome(module_etcd: EmbeddedEtcd,
                                                                          tmp_path: Path) -> None:
    """Finding 3: node 1 lost with no spare, the job fails at --replacement-timeout naming ranks [2, 3];
    then the lost node's own command again: exit 1 at once, the job's records untouched."""
    c = new_cluster(module_etcd.endpoint, tmp_path, "afterfail", REF_PAUSE_RANK="2", REF_PAUSE_STEP="2")
    try:
        c.start_leader_then_others("--replacement-timeout", "2")
        c.paused_pid(2)
        victim = c.agent_of_rank(2)
        os.kill(victim.pid, signal.SIGKILL)
        survivor = next(a for a in c.agents if a is not victim)
        assert wait_exit(survivor, 120, "the surviving agent") == 1
        before, ran = _records(c), _pids(c)
        code, took, log = _late_agent(c, "--replacement-timeout", "2")
        after = _records(c)
    finally:
        c.kill_all()
    assert "no replacement within 2s" in c.tail(100000)
    assert code == 1, log[-3000:]
    assert took < PROMPT_S, (took, log[-3000:])
    lines = [ln for ln in log.splitlines() if f"job {c.job_id!r} has already ended" in ln]
    assert len(lines) == 1 and "it failed" in lines[0] and "no replacement within 2s" in lines[0], log[-3000:]
    assert after == before  # not a key written, not even the node's own record
    assert _pids(c) == ran  # no worker of it ran


def test_an_agent_after_the_job_succeeded_exits_0_at_once_whatever_its_flags(module_etcd: EmbeddedEtcd,
                                                                             tmp_path: Path) -> None:
    """A job that finished: a new agent of it exits 0 at once (a scheduler must not read a finished job
    as failed), even one started with other flags and script arguments, and touches nothing."""
    c = new_cluster(module_etcd.endpoint, tmp_path, "aftersuccess")
    try:
        first = c.start_agent(nnodes="1")
        assert wait_exit(first, 120, "the job's one agent") == 0, c.tail()
        before = _records(c)
        code, took, log = _late_agent(c, "--replicas", "0", nproc=1, nnodes="1",
                                      script_args=(str(c.out / "elsewhere"), "more"))
        after = _records(c)
    finally:
        c.kill_all()
    assert code == 0, log[-3000:]
    assert took < PROMPT_S, (took, log[-3000:])
    lines = [ln for ln in log.splitlines() if f"job {c.job_id!r} has already ended" in ln]
    assert len(lines) == 1 and "it succeeded (all 2 ranks finished)" in lines[0], log[-3000:]
    assert after == before
    assert not (c.out / "elsewhere").exists()


def _refused(c: Cluster, first: tuple[str, ...], second: tuple[str, ...],
             second_args: tuple[str, ...] | None = None) -> tuple[int, float, str]:
    """Agent 0 (flags ``first``) in the rendezvous, then agent 1 (flags ``second``, script arguments
    ``second_args``): agent 1's exit code, how long it ran, its log; agent 0 is still waiting for its
    round, with no worker started, and obeys SIGTERM."""
    a = c.start_agent(*first)
    ks = Keyspace(c.job_id)
    with c.client() as client:
        def joined() -> bool:
            kv = client.get(ks.rdzv_state)
            return kv is not None and len(RoundState.from_bytes(kv.value).participants) == 1
        wait_until(joined, 60, "agent 0 in the rendezvous")
        t0 = time.monotonic()
        b = c.start_agent(*second, script_args=second_args)
        code = wait_exit(b, PROMPT_S * 2, "the agent that disagrees")
        took = time.monotonic() - t0
        kv = client.get(ks.rdzv_state)
        assert kv is not None
        st = RoundState.from_bytes(kv.value)
        assert st.state == "joining" and len(st.participants) == 1, st  # agent 0 still waits for a peer
    assert a.poll() is None and not list(c.out.glob("pids_rank*")), c.tail()
    a.send_signal(signal.SIGTERM)
    assert wait_exit(a, 30, "agent 0 after SIGTERM") == 128 + signal.SIGTERM
    return code, took, c.logs[1].read_text(errors="replace")


def _one_error_line(log: str) -> str:
    lines = [ln for ln in log.splitlines() if ln.startswith("ckptless-run: error:")]
    assert len(lines) == 1, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    return lines[0]


def test_agents_with_other_replicas_are_refused_in_seconds_naming_the_flag(module_etcd: EmbeddedEtcd,
                                                                           tmp_path: Path) -> None:
    """Finding 6: --replicas 1 and --replicas 2 in one job hung (mirror rounds timing out, still running
    at 240 s). The second agent is refused at the rendezvous: exit 2, one line, both values."""
    c = new_cluster(module_etcd.endpoint, tmp_path, "replicas")
    try:
        code, took, log = _refused(c, ("--replicas", "1"), ("--replicas", "2"))
    finally:
        c.kill_all()
    assert code == 2, log[-3000:]
    assert took < PROMPT_S, (took, log[-3000:])
    line = _one_error_line(log)
    assert "--replicas" in line and "this agent: 2" in line and "the job: 1" in line, line


def test_agents_with_other_script_arguments_are_refused_in_seconds(module_etcd: EmbeddedEtcd,
                                                                   tmp_path: Path) -> None:
    """Finding 6: other script arguments ended the job after 14.5 s in one run and hung in another.
    The second agent is refused at the rendezvous: exit 2, one line naming both argument lists."""
    c = new_cluster(module_etcd.endpoint, tmp_path, "scriptargs")
    mine = (str(c.out), "--lr", "0.5")
    try:
        code, took, log = _refused(c, (), (), mine)
    finally:
        c.kill_all()
    assert code == 2, log[-3000:]
    assert took < PROMPT_S, (took, log[-3000:])
    line = _one_error_line(log)
    assert "script arguments" in line and repr([str(c.out)]) in line and repr(list(mine)) in line, line
