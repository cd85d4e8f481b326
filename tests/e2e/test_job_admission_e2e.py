"""Who may take part in a job (issue 35, findings 3 and 6, and their review): an agent after the job's
end, an agent that disagrees with a live job, another job reusing an id.

Real etcd, real agents and workers. Finding 3: a node lost with no spare, the job ends at
``--replacement-timeout``; a new agent started with the same ``--rdzv-id`` afterwards waited for a
round that never closed (still running after 161 s). Now an agent whose job has ended exits at once
with one line giving the outcome (1 for a failed job, 0 for a finished one), and writes nothing of
the job's; a succeeded job is never trained again, whatever the agent's flags; a late agent of a
failed job that could relaunch it (its snapshots) gives up after the relaunch window, not after
join_timeout (900 s). Finding 6: two agents of one job with other ``--replicas`` (or other script
arguments) formed the job and hung or failed minutes later. Now the later one is refused in seconds
with one line naming the flag, the agent whose value the round holds and both values, before it
writes a key; an agent whose settings are not an ended run's is refused (exit 2) rather than told
"succeeded" without training.

Time bounds are measured from the agent's own first log line (written after Python's and torch's
import, and the etcd client): what the agent does after it starts is the point ("at once", not a
wait), and a cold start on two cores shared with other jobs varies by many seconds. Every wait
for an exit also has a hard deadline well above a cold start.
"""

from __future__ import annotations

import hashlib
import os
import re
import signal
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import pytest

from ckptless.coordinator.client import WatchEvent
from ckptless.coordinator.embedded import EmbeddedEtcd
from ckptless.coordinator.keyspace import Keyspace
from ckptless.coordinator.rendezvous import RoundState

from ..harness.cluster import Cluster, new_cluster, wait_exit
from ..harness.waiting import wait_until

PROMPT_S = 10.0  # from the agent's first log line to its exit: a few etcd reads, then one line
EXIT_DEADLINE_S = 120.0  # from the process's start: a cold start took up to ~20 s on 2 busy cores
WINDOW_S = 11.0  # the relaunch window by default: the last call (1 s) plus RESTART_GRACE_S


def _records(c: Cluster) -> dict[str, tuple[bytes, int]]:
    """Every key of the job with its value and the revision that last changed it."""
    with c.client() as client:
        kvs, _ = client.get_prefix(Keyspace(c.job_id).prefix)
    return {kv.key: (kv.value, kv.mod_revision) for kv in kvs}


def _pids(c: Cluster) -> dict[str, str]:
    """Every rank's record of the processes that ran it."""
    return {p.name: p.read_text() for p in c.out.glob("pids_rank*")}


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@dataclass
class Late:
    """A late agent's run: its exit code, seconds from its first log line to its exit, its log, and
    every write it made under the job's keys while it lived (keys or values naming its node)."""

    code: int
    took: float
    log: str
    writes: list[WatchEvent]


def _first_log_time(log: str) -> datetime:
    m = re.search(r"^\[ckptless-run (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ", log, re.M)
    assert m is not None, f"no log line of the agent's own: {log[-3000:]}"
    return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f")


def _late_agent(c: Cluster, *extra: str, **kw: object) -> Late:
    """A new agent of ``c``'s job; every event under the job's keys is watched while it lives, and a
    marker written after its exit says when the watch has delivered all of them."""
    events: list[WatchEvent] = []
    prefix = Keyspace(c.job_id).prefix
    marker = f"{prefix}test-marker/{uuid.uuid4().hex}"
    with c.client() as client:
        watch = client.watch_prefix(prefix, events.extend)
        try:
            proc = c.start_agent(*extra, **kw)  # type: ignore[arg-type]
            code = wait_exit(proc, EXIT_DEADLINE_S, "the late agent")
            exited = datetime.now()
            client.put(marker, "x")
            wait_until(lambda: any(e.key == marker for e in list(events)), 30, "the marker's watch event")
        finally:
            watch.cancel()
        client.delete(marker)
    log = c.logs[c.agents.index(proc)].read_text(errors="replace")
    tag = f"-{proc.pid}-"
    writes = [e for e in events if tag in e.key or tag in e.value.decode(errors="replace")]
    return Late(code, (exited - _first_log_time(log)).total_seconds(), log, writes)


def _ended_line(log: str, job_id: str) -> str:
    lines = [ln for ln in log.splitlines() if f"job {job_id!r} has already ended" in ln]
    assert len(lines) == 1, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    return lines[0]


def _one_error_line(log: str) -> str:
    lines = [ln for ln in log.splitlines() if ln.startswith("ckptless-run: error:")]
    assert len(lines) == 1, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    return lines[0]


def _fail_the_job(c: Cluster, *flags: str) -> None:
    """Two agents x 2 ranks; rank 2's agent SIGKILLed while rank 2 holds at its pause step: no spare, so
    the survivor ends the job at --replacement-timeout (2 s in ``flags``), exit 1."""
    c.start_leader_then_others(*flags)
    c.paused_pid(2)
    victim = c.agent_of_rank(2)
    os.kill(victim.pid, signal.SIGKILL)
    survivor = next(a for a in c.agents if a is not victim)
    assert wait_exit(survivor, 120, "the surviving agent") == 1
    assert "no replacement within 2s" in c.tail(100000)


def test_an_agent_after_the_job_failed_exits_1_at_once_naming_the_outcome(module_etcd: EmbeddedEtcd,
                                                                          tmp_path: Path) -> None:
    """Finding 3: node 1 lost with no spare, the job fails at --replacement-timeout naming ranks [2, 3];
    then the lost node's own command again: exit 1 at once, nothing of the job's written."""
    c = new_cluster(module_etcd.endpoint, tmp_path, "afterfail", REF_PAUSE_RANK="2", REF_PAUSE_STEP="2")
    try:
        _fail_the_job(c, "--replacement-timeout", "2")
        before, ran = _records(c), _pids(c)
        late = _late_agent(c, "--replacement-timeout", "2")
        after = _records(c)
    finally:
        c.kill_all()
    assert late.code == 1, late.log[-3000:]
    assert late.took < PROMPT_S, (late.took, late.log[-3000:])
    line = _ended_line(late.log, c.job_id)
    assert "it failed" in line and "no replacement within 2s" in line, line
    assert late.writes == [] and after == before  # not a key written, not even the node's own record
    assert _pids(c) == ran  # no worker of it ran


@pytest.mark.rotating(1)  # CI budget: tests/harness/rotation.py
def test_a_late_agent_of_a_failed_job_with_its_snapshots_gives_up_after_the_relaunch_window(
        module_etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    """Review finding 1: the job's own command carries --snapshot-dir, which holds its snapshots, so a
    scheduler's replacement agent after the failure was taken for a relaunch and waited join_timeout
    (900 s) in a round of its own. It may be a relaunch (a documented feature), but one that does not
    form within the window is the failed run's late agent: exit 1 with the job's end."""
    snaps = tmp_path / "snaps"
    flags = ("--replacement-timeout", "2", "--snapshot-every", "1", "--snapshot-dir", str(snaps))
    c = new_cluster(module_etcd.endpoint, tmp_path, "failsnap", REF_PAUSE_RANK="2", REF_PAUSE_STEP="4")
    try:
        c.start_leader_then_others(*flags)
        c.paused_pid(2)
        wait_until(lambda: any(snaps.rglob("COMPLETE.json")), 120, "a complete snapshot")
        victim = c.agent_of_rank(2)
        os.kill(victim.pid, signal.SIGKILL)
        survivor = next(a for a in c.agents if a is not victim)
        assert wait_exit(survivor, 120, "the surviving agent") == 1
        status_before, ran, kept = _records(c)[Keyspace(c.job_id).status], _pids(c), _tree(snaps)
        late = _late_agent(c, *flags)
        status_after = _records(c).get(Keyspace(c.job_id).status)
    finally:
        c.kill_all()
    assert late.code == 1, late.log[-3000:]
    assert f"this agent starts it again from its snapshots in {snaps}" in late.log, late.log[-3000:]
    assert WINDOW_S <= late.took < WINDOW_S + PROMPT_S, (late.took, late.log[-3000:])
    line = _ended_line(late.log, c.job_id)
    assert "it failed" in line and f"no relaunch of it formed within {WINDOW_S:g}s (1 of 2..2 node(s) came)" in line
    assert status_after == status_before and _pids(c) == ran and _tree(snaps) == kept  # nothing of the job's moved


def test_a_succeeded_job_is_never_trained_again_and_another_run_under_its_id_is_refused(
        module_etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    """A job that finished, its snapshots on disk. Review finding 1: its own command again (a
    scheduler's replacement) was taken for a relaunch from those snapshots and trained again; with
    --fresh-start it trained from step 0 and set them aside. Now the own command exits 0 at once
    (a scheduler must not read a finished job as failed), and --fresh-start, or other script arguments
    and --replicas (review finding 2: another job reusing the id, told "succeeded" without training), is
    refused with exit 2 naming each difference. Nothing of the job's is written or moved."""
    snaps = tmp_path / "snaps"
    flags = ("--snapshot-every", "2", "--snapshot-dir", str(snaps))
    c = new_cluster(module_etcd.endpoint, tmp_path, "aftersuccess")
    try:
        first = c.start_agent(*flags, nnodes="1")
        assert wait_exit(first, 180, "the job's one agent") == 0, c.tail()
        assert any(snaps.rglob("COMPLETE.json"))
        before, ran, kept = _records(c), _pids(c), _tree(snaps)
        own = _late_agent(c, *flags, nnodes="1")
        fresh = _late_agent(c, *flags, "--fresh-start", nnodes="1")
        other = _late_agent(c, *flags, "--replicas", "0", nproc=1, nnodes="1",
                            script_args=(str(c.out / "elsewhere"), "more"))
        after = _records(c)
    finally:
        c.kill_all()
    assert own.code == 0, own.log[-3000:]
    assert own.took < PROMPT_S, (own.took, own.log[-3000:])
    line = _ended_line(own.log, c.job_id)
    assert "it succeeded (all 2 ranks finished)" in line and "to train again, use a new --rdzv-id" in line, line
    assert fresh.code == 2 and fresh.took < PROMPT_S, (fresh.took, fresh.log[-3000:])
    assert ("this --rdzv-id belongs to an ended run with other settings (--fresh-start: the run used False, this "
            "agent True): use a new --rdzv-id") in _one_error_line(fresh.log)
    assert other.code == 2 and other.took < PROMPT_S, (other.took, other.log[-3000:])
    line = _one_error_line(other.log)
    assert "--replicas: the run used 1, this agent 0" in line, line
    assert f"script arguments: the run used {[str(c.out)]!r}, this agent {[str(c.out / 'elsewhere'), 'more']!r}" in line
    for late in (own, fresh, other):
        assert late.writes == [], late.writes
    assert after == before and _pids(c) == ran and _tree(snaps) == kept
    assert not (c.out / "elsewhere").exists()


@pytest.mark.rotating(2)  # CI budget: tests/harness/rotation.py
def test_rdzv_id_none_is_no_identity_a_new_job_under_it_trains(module_etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    """Review finding 2: with an external etcd `--rdzv-id none` is allowed (torchrun's default); after any
    job under it succeeded, the next, different job under it exited 0 at once without training."""
    c = Cluster(module_etcd.endpoint, tmp_path, "none")
    try:
        first = c.start_agent(nnodes="1")
        assert wait_exit(first, 180, "the first job under 'none'") == 0, c.tail()
        with c.client() as client:
            assert client.get(Keyspace("none").status) is not None  # its success is recorded
        out2 = tmp_path / "second"
        out2.mkdir()
        second = c.start_agent(nnodes="1", script_args=(str(out2),))
        assert wait_exit(second, 180, "the second job under 'none'") == 0, c.tail()
    finally:
        c.kill_all()
    log = c.logs[1].read_text(errors="replace")
    assert "has already ended" not in log and "ckptless-run: error" not in log, log[-3000:]
    assert sorted(p.name for p in out2.glob("final_rank*.pt")) == ["final_rank0.pt", "final_rank1.pt"], log[-3000:]


def _refused(c: Cluster, first: tuple[str, ...], second: tuple[str, ...],
             second_args: tuple[str, ...] | None = None) -> tuple[Late, str]:
    """Agent 0 (flags ``first``) in the rendezvous, then agent 1 (flags ``second``, script arguments
    ``second_args``): agent 1's run and agent 0's node id; agent 0 is still waiting for its round, with
    no worker started, and obeys SIGTERM."""
    a = c.start_agent(*first)
    ks = Keyspace(c.job_id)
    with c.client() as client:
        def joined() -> bool:
            kv = client.get(ks.rdzv_state)
            return kv is not None and len(RoundState.from_bytes(kv.value).participants) == 1
        wait_until(joined, 60, "agent 0 in the rendezvous")
        late = _late_agent(c, *second, script_args=second_args)
        kv = client.get(ks.rdzv_state)
        assert kv is not None
        st = RoundState.from_bytes(kv.value)
        assert st.state == "joining" and len(st.participants) == 1, st  # agent 0 still waits for a peer
    assert a.poll() is None and not list(c.out.glob("pids_rank*")), c.tail()
    a.send_signal(signal.SIGTERM)
    assert wait_exit(a, 30, "agent 0 after SIGTERM") == 128 + signal.SIGTERM
    return late, st.participants[0].node_id


def test_agents_with_other_replicas_are_refused_in_seconds_naming_the_flag(module_etcd: EmbeddedEtcd,
                                                                           tmp_path: Path) -> None:
    """Finding 6: --replicas 1 and --replicas 2 in one job hung (mirror rounds timing out, still running
    at 240 s). The second agent is refused before it writes a key: exit 2, one line, both values, and
    the node that holds the other value (review finding 3: it may be the one started wrong)."""
    c = new_cluster(module_etcd.endpoint, tmp_path, "replicas")
    try:
        late, opener = _refused(c, ("--replicas", "2"), ("--replicas", "1"))
    finally:
        c.kill_all()
    assert late.code == 2, late.log[-3000:]
    assert late.took < PROMPT_S, (late.took, late.log[-3000:])
    line = _one_error_line(late.log)
    assert f"--replicas: the agent that opened the round (node {opener} on " in line, line
    assert ") uses 2, this agent 1" in line, line
    assert late.writes == [], late.writes


def test_agents_with_other_script_arguments_are_refused_in_seconds(module_etcd: EmbeddedEtcd,
                                                                   tmp_path: Path) -> None:
    """Finding 6: other script arguments ended the job after 14.5 s in one run and hung in another.
    The second agent is refused at the rendezvous: exit 2, one line naming both argument lists."""
    c = new_cluster(module_etcd.endpoint, tmp_path, "scriptargs")
    mine = (str(c.out), "--lr", "0.5")
    try:
        late, _ = _refused(c, (), (), mine)
    finally:
        c.kill_all()
    assert late.code == 2, late.log[-3000:]
    assert late.took < PROMPT_S, (late.took, late.log[-3000:])
    line = _one_error_line(late.log)
    assert "script arguments: the agent that opened the round" in line, line
    assert f"uses {[str(c.out)]!r}, this agent {list(mine)!r}" in line, line


def test_late_and_spare_agents_that_disagree_with_a_running_job_are_refused_before_writing(
        module_etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    """Review finding 4: a late agent with other --replicas campaigned for leader, registered its node
    and published its link before the rendezvous refused it; a spare-only node was checked only after
    registering and waiting for the membership. Both are refused before their first write now."""
    c = new_cluster(module_etcd.endpoint, tmp_path, "liveothers", REF_PAUSE_RANK="0", REF_PAUSE_STEP="3",
                    REF_PAUSE_RELEASE="go")
    try:
        job = c.start_agent(nnodes="1")
        c.paused_pid(0)  # the job runs (its round closed), held at step 3
        late = _late_agent(c, "--replicas", "2", nnodes="1", nproc=3)  # 3 ranks: --replicas 2 is valid alone
        spare = _late_agent(c, "--replicas", "2", "--spares", "1", nnodes="1", nproc=0)
        c.release("go")
        assert wait_exit(job, 120, "the job's agent") == 0, c.tail()
    finally:
        c.kill_all()
    for refused in (late, spare):
        assert refused.code == 2, refused.log[-3000:]
        assert refused.took < PROMPT_S, (refused.took, refused.log[-3000:])
        line = _one_error_line(refused.log)
        assert "--replicas: the agent that opened the round (node " in line and ") uses 1, this agent 2" in line
        assert refused.writes == [], [(e.kind, e.key) for e in refused.writes]
