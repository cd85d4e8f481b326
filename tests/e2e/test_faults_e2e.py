"""Fault cases from the field, reproduced end to end: real etcd, real agents, real workers, real signals.

Each test is one row of the issue table (observed on a 2-agent x 2-worker
cluster, K = 1, lease TTL 1 s unless a test says otherwise) and checks the
outcome now required. Faults land at exact steps through the pause points of
tests/harness/scripts/train_ref.py; synchronisation is on files, etcd keys and
process exits, each with a deadline.

Bitwise check: a run with faults must end ``torch.equal`` to the fault-free
run. Rank r's trajectory is a function of (r, world size, steps) only:
mirroring, snapshots, spares and the node layout change how state is
protected, never what is trained. So one fault-free 4-rank baseline serves
every 4-rank configuration here; ``test_shm_k2_single_host_clean_run`` also
checks that claim directly for the 1-host x 4, K = 2 configuration.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from ckptless.coordinator.embedded import EmbeddedEtcd, etcd_binary
from ckptless.coordinator.keyspace import Keyspace
from ckptless.recovery.wire import Membership

from ..harness.cluster import (
    TRAIN,
    Cluster,
    FaultFree,
    assert_bitwise_equal,
    assert_recovered,
    assert_survivors_kept_pids,
    descendants_with_env,
    flip_byte,
    kill_when_paused,
    new_cluster,
    ring_holders,
    wait_exit,
    wait_membership,
)
from ..harness.repo import PYTHON, REPO, child_env
from ..harness.waiting import wait_json, wait_until

Finals = dict[int, dict[str, object]]
DEMO = str(REPO / "examples" / "train_demo.py")
NESTED_PREFIX = re.compile(r"\[rank\d+\]: *\[rank\d+\]:")


# --- helpers -------------------------------------------------------------------------------------
def _hold(seconds: float, c: Cluster, what: str) -> None:
    """Let a fault last ``seconds`` (the fault is the duration); fail at once if an agent gives up meanwhile."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        for a in c.agents:
            code = a.poll()
            if code is not None:
                raise AssertionError(f"agent {a.pid} exited {code} {time.monotonic() - start:.1f}s into {what}\n"
                                     f"{c.tail()}")
        time.sleep(0.05)


def _tracebacks(text: str) -> list[str]:
    return [line for line in text.splitlines() if "Traceback (most recent call last)" in line]


def _decisions(c: Cluster) -> Membership:
    m = c.membership()
    assert m is not None
    return m


def _etcdctl(endpoint: str, *args: str) -> None:
    ctl = Path(etcd_binary()).with_name("etcdctl")
    subprocess.run([str(ctl), f"--endpoints={endpoint}", *args], check=True, capture_output=True, timeout=30)


# --- 1. a second failure at the same committed version -------------------------------------------
@pytest.mark.rotating(1)  # CI budget: tests/harness/rotation.py
def test_second_failure_at_same_committed_version(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                                  baseline: FaultFree) -> None:
    """--mirror-every 4: v4 is committed; rank 1 dies at step 6 (resume v4), then rank 2 at step 7 while v4 is
    still the newest commit. Reports then hold v4 twice (old and re-protected replicas). Was: duplicate
    replica -> unrecoverable."""
    c = new_cluster(module_etcd.endpoint, tmp_path, "samever", REF_PAUSE_RANK="1", REF_PAUSE_STEP="6",
                     REF_PAUSE_RANK2="2", REF_PAUSE_STEP2="7", REF_PAUSE_COMMITTED="4")
    try:
        c.start_agent("--mirror-every", "4")
        c.start_agent("--mirror-every", "4")
        os.kill(c.paused_pid(1), signal.SIGKILL)
        m1 = wait_membership(c, 1)
        assert getattr(m1.decision, "resume_version", None) == 4, m1.decision
        os.kill(c.paused_pid(2, "2"), signal.SIGKILL)
        c.wait(timeout=120)
    finally:
        c.kill_all()
    assert_bitwise_equal(c.finals(), baseline.finals)
    assert _decisions(c).generation >= 2
    assert_survivors_kept_pids(c, {1, 2})


# --- 2. etcd with authentication ----------------------------------------------------------------
def test_etcd_auth_job_runs_and_recovers(etcd: EmbeddedEtcd, tmp_path: Path, baseline: FaultFree) -> None:
    """Correct CKPTLESS_ETCD_USER/PASSWORD: agents *and* workers authenticate. Was: workers died with
    ``etcdserver: user name is empty``."""
    _etcdctl(etcd.endpoint, "user", "add", "root", "--new-user-password=s3cret")
    _etcdctl(etcd.endpoint, "role", "add", "root")
    _etcdctl(etcd.endpoint, "user", "grant-role", "root", "root")
    _etcdctl(etcd.endpoint, "auth", "enable")
    c = new_cluster(etcd.endpoint, tmp_path, "auth", REF_PAUSE_RANK="1", REF_PAUSE_STEP="5")
    c.user, c.password = "root", "s3cret"
    try:
        c.start_agent()
        c.start_agent()
        os.kill(c.paused_pid(1), signal.SIGKILL)
        c.wait(timeout=120)
    finally:
        c.kill_all()
    assert_recovered(c, baseline, {1})
    assert "user name is empty" not in c.log_text()


# --- 3. a warm spare that died while idle -------------------------------------------------------
@pytest.mark.rotating(0)  # CI budget: tests/harness/rotation.py
def test_dead_idle_spare_is_never_assigned(module_etcd: EmbeddedEtcd, tmp_path: Path, baseline: FaultFree) -> None:
    """The only warm spare is SIGKILLed while waiting, then a worker dies: the rank is respawned, the dead
    spare never named in a plan. Was: dead spare assigned -> the job died after 180 s."""
    c = new_cluster(module_etcd.endpoint, tmp_path, "deadspare", REF_PAUSE_RANK="2", REF_PAUSE_STEP="5")
    ks = Keyspace(c.job_id)
    try:
        spare_agent = c.start_agent("--spares", "1")
        c.start_agent()
        victim = c.paused_pid(2)
        spares = descendants_with_env(spare_agent.pid, "CKPTLESS_ROLE", "spare")
        assert len(spares) == 1, spares
        spare = spares[0]
        env = dict(kv.split(b"=", 1) for kv in Path(f"/proc/{spare}/environ").read_bytes().split(b"\0") if b"=" in kv)
        spare_id = env[b"CKPTLESS_WORKER_ID"].decode()
        hb = Path(env[b"CKPTLESS_HEARTBEAT_FILE"].decode())
        wait_until(hb.exists, 60, "the spare waiting in ckptless.init() (its heartbeat file)")
        with c.client() as cl:
            assert len(cl.get_prefix(ks.spares_prefix)[0]) == 1
            os.kill(spare, signal.SIGKILL)
            wait_until(lambda: not cl.get_prefix(ks.spares_prefix)[0], 30, "the dead spare leaving the pool")
        os.kill(victim, signal.SIGKILL)
        c.wait(timeout=120)
    finally:
        c.kill_all()
    assert_bitwise_equal(c.finals(), baseline.finals)
    m = _decisions(c)
    assert spare_id not in {a.worker_id for a in m.ranks}, m
    assert m.worker_of(2).source == "respawn", m
    assert c.pids(2)[-1]["role"] == "replacement"
    assert_survivors_kept_pids(c, {2})


# --- 4. world size 1, and K >= world -------------------------------------------------------------
def test_world_size_one_failure_ends_job_at_once(module_etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    """One node, one worker: nothing to mirror to, so a failure ends the job at once, clearly, non-zero.
    Was: the leader loop retried a ConfigError forever."""
    c = new_cluster(module_etcd.endpoint, tmp_path, "world1", REF_PAUSE_RANK="0", REF_PAUSE_STEP="3")
    try:
        agent = c.start_agent(nnodes="1", nproc=1)
        os.kill(c.paused_pid(0), signal.SIGKILL)
        t0 = time.monotonic()
        code = wait_exit(agent, 30, "the agent of a world-size-1 job whose only worker died")
        took = time.monotonic() - t0
    finally:
        c.kill_all()
    text = c.log_text()
    assert code != 0, text
    assert took < 15, f"the job took {took:.1f}s to end\n{text}"
    assert "rank 0" in text and ("signal 9" in text or "SIGKILL" in text), text
    assert len(c.pids(0)) == 1, "a world-size-1 job must not respawn its worker"
    assert "ConfigError" not in text, text


@pytest.mark.parametrize("nnodes,nproc,replicas", [("2", 2, 4), ("1", 2, 2), ("1", 4, 7)])
def test_replicas_not_below_world_refused_at_start(module_etcd: EmbeddedEtcd, tmp_path: Path, nnodes: str, nproc: int,
                                                   replicas: int) -> None:
    """--replicas >= world size: refused before anything starts, one line naming ``replicas``, exit 2."""
    job = f"krefuse-{uuid.uuid4().hex[:6]}"
    r = subprocess.run(
        [PYTHON, "-m", "ckptless.launcher.main", "--nnodes", nnodes, "--nproc-per-node", str(nproc),
         "--rdzv-id", job, "--rdzv-endpoint", module_etcd.endpoint, "--replicas", str(replicas), TRAIN, str(tmp_path)],
        env=child_env(), capture_output=True, text=True, timeout=60)
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert len(err.splitlines()) == 1 and "replicas" in err and "Traceback" not in err, err
    assert not list(tmp_path.glob("pids_rank*")), "workers were started"


# --- 5. a corrupt newest disk snapshot, then a loss beyond K ------------------------------------
@pytest.mark.rotating(0)  # CI budget: tests/harness/rotation.py
@pytest.mark.timeout(300)  # see the report: uncoordinated snapshot skips can stall the job's end by 60 s
def test_corrupt_newest_snapshot_then_beyond_k_loss(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                                    baseline: FaultFree) -> None:
    """--snapshot-every 2: complete snapshots at steps 2 and 4; one byte of step 4 flipped (same size); rank 0
    and its only holder die at step 5: every rank must load step 2. Was: the corrupt snapshot was picked 50
    times.

    Rank 0 is held before step 3 until snapshot 2 is complete, so snapshot 4 is not skipped as "previous one
    still being written" (on this slow machine the first DCP write outlasts two steps)."""
    a = 0
    holder = ring_holders()[a][0]
    snaps = tmp_path / "snaps"
    c = new_cluster(module_etcd.endpoint, tmp_path, "badsnap", REF_PAUSE_RANK=str(a), REF_PAUSE_STEP="5",
                     REF_PAUSE_RANK2=str(holder), REF_PAUSE_STEP2="5", REF_PAUSE_RANK3=str(a), REF_PAUSE_STEP3="3",
                     REF_PAUSE_RELEASE="release")
    try:
        # Replicas in worker memory only: with the node-local tier (the default) the two dead ranks'
        # own images would outlive them and no disk would be needed.
        c.start_agent("--snapshot-every", "2", "--snapshot-dir", str(snaps), "--no-shm-dir")
        c.start_agent("--snapshot-every", "2", "--snapshot-dir", str(snaps), "--no-shm-dir")
        c.paused_pid(a, "3")
        jdir = snaps / c.job_id
        wait_until(lambda: (jdir / "step_00000002" / "COMPLETE.json").exists(), 60, "snapshot step 2 complete")
        c.release("release3")
        pa, ph = c.paused_pid(a), c.paused_pid(holder, "2")
        s4 = jdir / "step_00000004"
        wait_until(lambda: (s4 / "COMPLETE.json").exists(), 60, "snapshot step 4 complete")
        flip_byte(next((s4 / "rank0").glob("*.distcp")))
        os.kill(pa, signal.SIGKILL)
        os.kill(ph, signal.SIGKILL)
        c.wait(timeout=200)
    finally:
        c.kill_all()
    assert_bitwise_equal(c.finals(), baseline.finals)
    m = _decisions(c)
    assert type(m.decision).__name__ == "DiskFallback" and getattr(m.decision, "snapshot_step", None) == 2, m.decision
    assert m.generation == 1, f"the corrupt snapshot cost {m.generation - 1} extra generations"
    assert "snapshot step 4" in c.log_text(), "the rejection of the corrupt snapshot is not reported"


# --- 6./7. the /dev/shm peer store --------------------------------------------------------------
@pytest.mark.slow  # CI budget: kill recovery and K=2 shm naming are also exercised by CI's other e2e tests
def test_shm_k2_single_host_clean_run(module_etcd: EmbeddedEtcd, tmp_path: Path, dev_shm_dir: Path,
                                      baseline: FaultFree) -> None:
    """--nnodes 1 --nproc-per-node 4 --replicas 2 --shm-dir: holders of one owner share /dev/shm.
    Was: ENOENT on a .json.tmp -> unrecoverable; files left in /dev/shm."""
    c = new_cluster(module_etcd.endpoint, tmp_path, "shmk2")
    try:
        c.start_agent("--replicas", "2", "--shm-dir", str(dev_shm_dir), nnodes="1", nproc=4)
        c.wait(timeout=120)
    finally:
        c.kill_all()
    text = c.log_text()
    assert "No such file" not in text and "ENOENT" not in text, text
    finals = c.finals()
    assert all(int(f["recoveries"]) == 0 for f in finals.values()), "a fault-free run recovered"  # type: ignore[call-overload]
    assert_bitwise_equal(finals, baseline.finals)
    assert sorted(os.listdir(dev_shm_dir)) == [], "files left in /dev/shm after a clean run"


def test_corrupt_shm_replica_rebuilt_from_other_holder(module_etcd: EmbeddedEtcd, tmp_path: Path, dev_shm_dir: Path,
                                                       baseline: FaultFree) -> None:
    """K = 2 on one host: one holder's /dev/shm replica of rank 1 gets a same-size bit flip, then rank 1 dies.
    Was: IntegrityError crashed every rank. Now: rebuilt from the other holder."""
    holders = ring_holders(4, per_node=4, replicas=2)[1]
    assert len(holders) == 2
    bad = holders[0]
    c = new_cluster(module_etcd.endpoint, tmp_path, "shmbad", REF_PAUSE_RANK="1", REF_PAUSE_STEP="5")
    try:
        c.start_agent("--replicas", "2", "--shm-dir", str(dev_shm_dir), nnodes="1", nproc=4)
        victim = c.paused_pid(1)

        def replicas_of_v5() -> list[Path]:
            out = []
            for j in dev_shm_dir.glob(f"*-o1-h{bad}-s*.json"):
                try:
                    if json.loads(j.read_bytes()).get("version") == 5:
                        out.append(j)
                except (OSError, ValueError):
                    pass
            return out

        # v5 (the state after 5 steps) is mirrored while rank 1 holds before step 5; nothing is written after.
        wait_until(lambda: bool(replicas_of_v5()), 60, f"holder {bad}'s replica of rank 1 v5 in {dev_shm_dir}")
        bins = sorted(dev_shm_dir.glob(f"*-o1-h{bad}-s*.bin"))
        assert bins, sorted(os.listdir(dev_shm_dir))
        for b in bins:  # both slots: whichever version recovery picks is corrupt at this holder
            flip_byte(b)
        os.kill(victim, signal.SIGKILL)
        c.wait(timeout=120)
    finally:
        c.kill_all()
    assert_recovered(c, baseline, {1})
    assert "IntegrityError" not in "".join(line for line in c.log_text().splitlines() if "Traceback" in line)


# --- 8. sys.exit(N) in the user's step -----------------------------------------------------------
def test_sys_exit_in_step_ends_job_with_that_code(module_etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    """``sys.exit(3)`` on rank 1 at step 3: that rank exits 3, is not respawned, every agent exits non-zero
    promptly, and the summary names rank 1 and exit code 3. Was: SIGABRT, respawned 2-9 times, exit 1."""
    c = new_cluster(module_etcd.endpoint, tmp_path, "sysexit", REF_EXIT_RANK="1", REF_EXIT_STEP="3",
                     REF_EXIT_KIND="exit:3")
    try:
        c.start_agent()
        c.start_agent()
        doc = wait_json(c.out / "exiting_rank1.json", 120)
        codes = [wait_exit(a, 30, f"agent {a.pid} after rank 1 called sys.exit(3)") for a in c.agents]
        took = time.time() - float(doc["time"])
        rec = c.exit_record(1)
    finally:
        c.kill_all()
    text = c.log_text()
    assert all(code != 0 for code in codes), (codes, text)
    assert took < 20, f"the job ended {took:.1f}s after the exit\n{text}"
    assert rec is not None and rec.exitcode == 3 and rec.signal is None and rec.pid == doc["pid"], rec
    assert len(c.pids(1)) == 1, f"rank 1 was respawned into its own sys.exit: {c.pids(1)}"
    assert "SIGABRT" not in text and "Signal 6" not in text and "signal 6" not in text, text
    m = re.search(r"Root Cause \(first observed failure\):\n\[0\]:\n(?:.*\n){0,3}?\s*rank\s*: 1\b.*\n\s*exitcode\s*: 3\b",
                  text)
    assert m, f"the failure summary does not name rank 1 with exit code 3\n{text}"


# --- 9. etcd gone for good in the middle of a run ------------------------------------------------
@pytest.mark.slow  # the fault is a 12 s outage, on top of a full job
def test_etcd_lost_mid_run_healthy_job_finishes(etcd: EmbeddedEtcd, tmp_path: Path, baseline: FaultFree) -> None:
    """etcd is killed after step 4 and never comes back; the job is held 12 s into the outage (past the 10 s
    etcd call deadline), then released: the healthy workers finish, agents exit 0. Was: agents gave up 11 s
    later and killed healthy workers."""
    c = new_cluster(etcd.endpoint, tmp_path, "etcdgone", REF_PAUSE_RANK="0", REF_PAUSE_STEP="4",
                     REF_PAUSE_RELEASE="release")
    try:
        c.start_agent()
        c.start_agent()
        c.paused_pid(0)
        etcd.kill()
        _hold(12.0, c, "the etcd outage")
        c.release()
        c.wait(timeout=90)
    finally:
        c.kill_all()
    assert_recovered(c, baseline, set())


def test_etcd_lost_for_good_at_the_end_finished_job_exits_zero(etcd: EmbeddedEtcd, tmp_path: Path,
                                                              baseline: FaultFree) -> None:
    """etcd is killed two steps before the end and never comes back: every rank finishes, and every
    agent (the store's host too, which cannot read the others' exit records) exits 0 within seconds
    of the grace, with no false 'cut off ... re-planned elsewhere'. Was: exit 1 after 77 s."""
    c = new_cluster(etcd.endpoint, tmp_path, "etcdend", REF_PAUSE_RANK="0", REF_PAUSE_STEP="8",
                     REF_PAUSE_RELEASE="release")
    try:
        c.start_agent("--node-grace", "2")
        c.start_agent("--node-grace", "2")
        c.paused_pid(0)
        etcd.kill()
        c.release()
        c.wait(timeout=60)
    finally:
        c.kill_all()
    assert_bitwise_equal(c.finals(), baseline.finals)
    assert "re-planned elsewhere" not in c.log_text(), c.tail()


# --- 10. an agent paused shorter than the node grace period --------------------------------------
@pytest.mark.rotating(0)  # CI budget: tests/harness/rotation.py
def test_agent_paused_shorter_than_node_grace(module_etcd: EmbeddedEtcd, tmp_path: Path, baseline: FaultFree) -> None:
    """SIGSTOP the non-leading agent for 8 s (its 1 s lease expires; --node-grace is 10 s), then SIGCONT:
    its ranks were never lost. Was: ranks declared lost, unrecoverable."""
    c = new_cluster(module_etcd.endpoint, tmp_path, "agentstop", REF_PAUSE_RANK="2", REF_PAUSE_STEP="5",
                     REF_PAUSE_RELEASE="release")
    ks = Keyspace(c.job_id)
    try:
        c.start_leader_then_others()
        c.paused_pid(2)
        agent = c.agent_of_rank(2)
        assert agent is not c.leader_agent()
        with c.client() as cl:
            def node_keys() -> set[str]:
                return {kv.key for kv in cl.get_prefix(ks.nodes_prefix)[0]}

            def link_keys() -> set[str]:
                return {kv.key for kv in cl.get_prefix(ks.links_prefix)[0]}

            wait_until(lambda: len(link_keys()) == 2, 30, "both agents' links/<node> (after their probes)")
            before, links = node_keys(), link_keys()
            os.kill(agent.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            try:
                wait_until(lambda: len(node_keys()) < len(before), 7, "the paused agent's lease expiring")
                _hold(8.0 - (time.monotonic() - t0), c, "the agent's pause")  # the fault is the 8 s pause itself
            finally:
                os.kill(agent.pid, signal.SIGCONT)
            # Its keys went with the old lease; the renewal puts them back, links/<node> too (ckptless status).
            wait_until(lambda: node_keys() == before and link_keys() == links, 30, "the agent's keys back")
        c.release()
        c.wait(timeout=90)
    finally:
        c.kill_all()
    assert_recovered(c, baseline, set())


# --- 11. a kill before anything was committed -----------------------------------------------------
def test_kill_before_first_commit_restarts_from_initial_state(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                                             baseline: FaultFree) -> None:
    """Rank 1 is killed after init(), before run() captured or mirrored anything: no version is committed,
    so the job restarts from the initial state. Was: unrecoverable."""
    c = new_cluster(module_etcd.endpoint, tmp_path, "precommit", REF_PAUSE_RANK="1", REF_PAUSE_STEP="-1")
    try:
        c.start_agent()
        c.start_agent()
        victim = c.paused_pid(1)
        os.kill(victim, signal.SIGKILL)
        c.wait(timeout=120)
    finally:
        c.kill_all()
    assert_bitwise_equal(c.finals(), baseline.finals)
    # train_ref may record a pid only at the process's first step, which the victim never ran.
    ran1 = c.pids(1)
    assert ran1[-1]["role"] == "replacement" and ran1[-1]["pid"] != victim, ran1
    for r in (0, 2, 3):
        assert len(c.pids(r)) == 1, f"survivor rank {r} was restarted: {c.pids(r)}"


# --- 12. a spare-only launcher running another script ---------------------------------------------
@pytest.mark.slow  # two launchers and a cold respawn: ~60-90 s on 2 cores
def test_spare_only_launcher_with_other_script_refused(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                                      baseline: FaultFree) -> None:
    """A ``--nproc-per-node 0 --spares 1`` launcher started with job A's --rdzv-id but another script must be
    refused at join, naming the mismatch; job A then recovers a kill by respawn and finishes bitwise equal.
    Was: admitted as a rank, StateError, job A lost."""
    c = new_cluster(module_etcd.endpoint, tmp_path, "wrongspare", REF_PAUSE_RANK="1", REF_PAUSE_STEP="5")
    ks = Keyspace(c.job_id)
    stray_out = tmp_path / "stray"
    stray_out.mkdir()
    problems: list[str] = []
    try:
        c.start_agent()
        c.start_agent()
        victim = c.paused_pid(1)
        stray = c.start_agent("--spares", "1", nproc=0, script=DEMO, script_args=(str(stray_out),))
        with c.client() as cl:
            wait_until(lambda: stray.poll() is not None or bool(cl.get_prefix(ks.spares_prefix)[0]), 60,
                       "the spare-only launcher to be refused or to offer its spare")
        if stray.poll() is None:
            problems.append("the launcher running another script was admitted to the spare pool")
        os.kill(victim, signal.SIGKILL)
        try:
            code = wait_exit(stray, 60, "the spare-only launcher")
        except AssertionError as exc:
            code = None
            problems.append(str(exc))
        for a in c.agents[:2]:
            rc = wait_exit(a, 120, f"job A's agent {a.pid}")
            if rc != 0:
                problems.append(f"job A's agent {a.pid} exited {rc}")
    finally:
        c.kill_all()
    stray_log = c.logs[2].read_text(errors="replace")
    if code in (None, 0):
        problems.append(f"the spare-only launcher exited {code}")
    if not re.search(r"script|fingerprint|mismatch", stray_log, re.I):
        problems.append("no message naming the mismatch")
    if not problems:
        assert_bitwise_equal(c.finals(), baseline.finals)
        assert c.pids(1)[-1]["role"] == "replacement"
    assert not problems, "; ".join(problems) + "\n" + c.tail()


# --- 13. log output ------------------------------------------------------------------------------
def test_clean_run_logs_one_prefix_no_tracebacks(baseline: FaultFree) -> None:
    """A fault-free run: every worker line carries one ``[rankN]:`` prefix at most, and nothing prints a
    traceback (was: ``Exception in thread pyetcd_watch`` at the end of every clean run)."""
    text = baseline.cluster.log_text()
    assert not NESTED_PREFIX.search(text), [line for line in text.splitlines() if NESTED_PREFIX.search(line)][:5]
    assert not _tracebacks(text) and "Exception in thread" not in text, text[-6000:]


# --- 14. a deterministic user exception vs a SIGKILL at the same step ------------------------------
def test_user_exception_fails_fast_without_respawn(module_etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    """``raise ValueError`` on rank 1 at step 3 (every incarnation would): the job ends in well under a
    minute, non-zero, with the user's traceback in the agent output; rank 1 is never respawned; survivors
    leave without tracebacks; one prefix per line."""
    c = new_cluster(module_etcd.endpoint, tmp_path, "usererr", REF_EXIT_RANK="1", REF_EXIT_STEP="3")
    try:
        c.start_agent()
        c.start_agent()
        doc = wait_json(c.out / "exiting_rank1.json", 120)
        codes = [wait_exit(a, 45, f"agent {a.pid} after rank 1 raised") for a in c.agents]
        took = time.time() - float(doc["time"])
    finally:
        c.kill_all()
    text = c.log_text()
    assert all(code != 0 for code in codes), (codes, text)
    assert took < 20, f"the job ended {took:.1f}s after the user's exception\n{text}"
    assert "ValueError: REF_EXIT: deliberate user error on rank 1 at step 3" in text, text
    assert re.search(r'train_ref\.py", line \d+, in user_failure', text), "the user's traceback is not shown\n" + text
    for r in range(4):
        assert len(c.pids(r)) == 1, f"rank {r} was respawned: {c.pids(r)}"
    assert not NESTED_PREFIX.search(text), [line for line in text.splitlines() if NESTED_PREFIX.search(line)][:5]
    others = [line for line in _tracebacks(text) if not line.startswith("[rank1]:") and "traceback :" not in line]
    assert not others, f"tracebacks from ranks other than the failing one: {others}\n{text}"
    assert "Exception in thread" not in text, text


@pytest.mark.slow  # CI budget: kill recovery and K=2 shm naming are also exercised by CI's other e2e tests
def test_sigkill_at_the_same_step_is_recovered(module_etcd: EmbeddedEtcd, tmp_path: Path, baseline: FaultFree) -> None:
    """The fault twin of the test above: SIGKILL of rank 1 at step 3 is recovered, bitwise equal."""
    c = new_cluster(module_etcd.endpoint, tmp_path, "kill3", REF_PAUSE_RANK="1", REF_PAUSE_STEP="3")
    kill_when_paused(c, 1, timeout=120)
    assert_recovered(c, baseline, {1})
    assert c.pids(1)[-1]["role"] == "replacement"


# --- found while writing these: a rank declared lost while alive --------------------------------
@pytest.mark.slow  # a 5 s collective timeout plus the leader's 15 s report deadline
def test_silent_rank_declared_lost_is_respawned_once(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                                     baseline: FaultFree) -> None:
    """Rank 2 is frozen (SIGSTOP, no --hang-timeout): the others' collective times out, they report, rank 2 does
    not and is declared lost at the report deadline; its agent must SIGKILL the frozen process and respawn the
    rank in that same generation. Kill and respawn of one slot must not race: the respawn must not fail with
    "still running", and the old incarnation's death must not be recorded as the replacement's (a spurious
    incident and an extra generation)."""
    c = new_cluster(module_etcd.endpoint, tmp_path, "silent", REF_PAUSE_RANK="2", REF_PAUSE_STEP="5",
                     CKPTLESS_COLLECTIVE_TIMEOUT="5")
    try:
        c.start_agent()
        c.start_agent()
        frozen = c.paused_pid(2)
        os.kill(frozen, signal.SIGSTOP)
        c.wait(timeout=150)
    finally:
        c.kill_all()
    assert_bitwise_equal(c.finals(), baseline.finals)
    text = c.log_text()
    assert "respawn of rank 2 failed" not in text, text
    m = _decisions(c)
    assert m.generation == 1, f"{m.generation - 1} extra generation(s) after one loss\n{c.tail()}"
    assert_survivors_kept_pids(c, {2})
