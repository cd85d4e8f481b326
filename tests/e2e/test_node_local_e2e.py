"""The node-local tier end to end (issue 9): a worker respawned on its node restores its own image
from the node's shared memory, not from its peers; a lost node's files do not outlive it on a shared
host (issue 17). Real etcd, real launcher, real SIGKILL.

Reference job: tests/harness/scripts/train_ref.py, 2 agents x 2 workers, K = 1, ``--shm-dir`` in a private
directory under /dev/shm. Rank 1 holds before step 5; the test waits until the committed v5 of its own
image is recorded in that directory (its manifest beside the buffer), then SIGKILLs it. Every run must
end ``torch.equal`` to the fault-free run.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from ckptless.coordinator.embedded import EmbeddedEtcd
from ckptless.mirror.shm import list_files, node_tag
from ckptless.recovery.decision import RecoveryPlan
from ckptless.recovery.view import ExitRecord
from ckptless.recovery.wire import Membership

from ..harness.cluster import Cluster, FaultFree, assert_bitwise_equal, flip_byte, new_cluster, wait_membership
from ..harness.waiting import wait_json, wait_until

VICTIM, STEP = 1, 5
# The baseline (conftest.py) runs without --shm-dir: how state is protected never changes what is trained.


def _cluster(etcd: EmbeddedEtcd, tmp_path: Path, shm: Path, name: str, **env: str) -> Cluster:
    pause = {"REF_PAUSE_RANK": str(VICTIM), "REF_PAUSE_STEP": str(STEP)}
    c = new_cluster(etcd.endpoint, tmp_path, name, **{**pause, **env})
    (c.out / "goodput").mkdir()
    return c


def _start(c: Cluster, shm: Path) -> int:
    """Both agents up; returns the victim's pid once it holds before STEP."""
    for _ in range(2):
        c.start_agent("--shm-dir", str(shm), "--goodput-dir", str(c.out / "goodput"))
    return c.paused_pid(VICTIM)


def _kill_victim_and_finish(c: Cluster, victim: int) -> tuple[Membership, ExitRecord | None]:
    """SIGKILL the victim; the membership of its recovery and its exit record; then the job runs to its end."""
    os.kill(victim, signal.SIGKILL)
    m = wait_membership(c, 1)
    rec = c.exit_record(VICTIM)
    c.wait()
    return m, rec


def _committed_own_image(shm: Path, version: int) -> tuple[Path, dict[str, Any]]:
    """Wait until the victim's own image of ``version`` is committed in ``shm``: (payload, manifest)."""
    found: list[tuple[Path, dict[str, Any]]] = []

    def ready() -> bool:
        for j in shm.glob(f"*-r{VICTIM}-own-*.json"):
            try:
                doc = json.loads(j.read_bytes())
            except (OSError, ValueError):
                continue
            if doc.get("version") == version and doc.get("owner") == VICTIM:
                found.append((j.with_suffix(".bin"), doc))
                return True
        return False

    wait_until(ready, 120, f"rank {VICTIM}'s committed own image v{version} in {shm}", interval_s=0.02)
    return found[-1]


def _ledger(c: Cluster, rank: int) -> list[dict[str, Any]]:
    path = c.out / "goodput" / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _restores(c: Cluster, rank: int) -> list[tuple[int, str, int]]:
    """(generation, source, bytes received) of every recovery this rank went through, in order."""
    evs = _ledger(c, rank)
    got = []
    for e in evs:
        if e["kind"] == "rollback_done":
            g = int(e["generation"])
            nbytes = [int(x["attrs"]["bytes"]) for x in evs
                      if x["kind"] == "transfer_done" and x["generation"] == g]
            got.append((g, str(e["attrs"]["source"]), nbytes[-1] if nbytes else -1))
    return got


@pytest.mark.rotating(0)  # CI budget: tests/harness/rotation.py
def test_respawn_restores_its_own_image_from_node_local_memory(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                                               dev_shm_dir: Path, baseline: FaultFree) -> None:
    c = _cluster(module_etcd, tmp_path, dev_shm_dir, "nlocal")
    try:
        victim = _start(c, dev_shm_dir)
        _, manifest = _committed_own_image(dev_shm_dir, STEP)
        m, rec = _kill_victim_and_finish(c, victim)
    finally:
        c.kill_all()
    assert rec is not None and rec.signal == signal.SIGKILL and rec.local_image is not None, rec
    assert (rec.local_image.version, rec.local_image.n_chunks) == (STEP, len(manifest["chunk_checksums"]))
    d = m.decision
    assert isinstance(d, RecoveryPlan) and d.resume_version == STEP, d
    assert [(x.rank, x.version) for x in d.node_local] == [(VICTIM, STEP)], d
    assert not d.transfers, f"holders sent stripes of an image the node kept: {d.transfers}"
    assert m.worker_of(VICTIM).source == "respawn" and m.worker_of(VICTIM).node_id == rec.node_id
    assert _restores(c, VICTIM) == [(1, "node-local", 0)], _ledger(c, VICTIM)
    for r in range(4):  # the partial re-protection round (MISSING) after the recovery committed everywhere
        assert any(e["kind"] == "reprotect_done" and e["generation"] == 1 for e in _ledger(c, r)), _ledger(c, r)
    assert f"resumed at step {STEP} in generation 1 (node-local)" in c.log_text()
    assert_bitwise_equal(c.finals(), baseline.finals)
    assert c.pids(VICTIM)[-1]["role"] == "replacement"
    assert sorted(os.listdir(dev_shm_dir)) == [], "files left in the shm dir after the job"


@pytest.mark.slow  # CI budget: the fallback to peers runs in CI through the corrupted-after-check case
def test_own_image_corrupt_at_rest_is_not_offered_and_peers_send_it(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                                                     dev_shm_dir: Path, baseline: FaultFree) -> None:
    """A byte of the committed own image flips before the worker dies: its agent's checksum finds it,
    the exit record carries no node-local image, and the holder sends the image as before."""
    c = _cluster(module_etcd, tmp_path, dev_shm_dir, "nlrot")
    try:
        victim = _start(c, dev_shm_dir)
        payload, manifest = _committed_own_image(dev_shm_dir, STEP)
        flip_byte(payload, int(manifest["total_bytes"]) // 2)
        m, rec = _kill_victim_and_finish(c, victim)
    finally:
        c.kill_all()
    assert rec is not None and rec.local_image is None, rec
    d = m.decision
    assert isinstance(d, RecoveryPlan) and not d.node_local and [t.owner for t in d.transfers] == [VICTIM], d
    ((gen, source, nbytes),) = _restores(c, VICTIM)
    assert (gen, source) == (1, "peers") and nbytes == int(manifest["total_bytes"]), _ledger(c, VICTIM)
    assert "corrupt chunk" in c.log_text()
    assert_bitwise_equal(c.finals(), baseline.finals)


@pytest.mark.slow  # CI budget: CI runs the node-local restore itself; the fallbacks run in the slow tier
def test_own_image_corrupted_after_the_agent_checked_it_falls_back_to_peers(
        module_etcd: EmbeddedEtcd, tmp_path: Path, dev_shm_dir: Path, baseline: FaultFree) -> None:
    """The byte flips after the agent verified the image and the plan chose it: the respawn's own
    re-check fails, it reports a failed restore, and the next plan pulls its image from the holder."""
    chaos = tmp_path / "chaos"
    c = _cluster(module_etcd, tmp_path, dev_shm_dir, "nllate", CKPTLESS_CHAOS_DIR=str(chaos),
                 CKPTLESS_CHAOS_POINTS=f"nl=restore:node-local:r{VICTIM}")
    try:
        victim = _start(c, dev_shm_dir)
        payload, manifest = _committed_own_image(dev_shm_dir, STEP)
        os.kill(victim, signal.SIGKILL)
        wait_json(chaos / "paused_nl.json", 120)  # the respawn is about to read the image the plan named
        m1 = c.membership()
        rec = c.exit_record(VICTIM)
        flip_byte(payload, int(manifest["total_bytes"]) // 2)
        (chaos / "release_nl").write_text("go")
        m2 = wait_membership(c, 2)
        c.wait()
    finally:
        c.kill_all()
    assert rec is not None and rec.local_image is not None and rec.local_image.version == STEP, rec
    assert m1 is not None and isinstance(m1.decision, RecoveryPlan) and m1.decision.node_local, m1
    d2 = m2.decision
    assert isinstance(d2, RecoveryPlan) and not d2.node_local, d2
    assert [t.owner for t in d2.transfers] == [VICTIM] and d2.resume_version == STEP, d2
    assert [(g, s) for g, s, _ in _restores(c, VICTIM)] == [(m2.generation, "peers")], _ledger(c, VICTIM)
    assert "corrupt chunk" in c.log_text()
    assert len(c.pids(VICTIM)) == 2, "the respawn whose node-local copy was bad must stay (not be killed)"
    assert_bitwise_equal(c.finals(), baseline.finals)


@pytest.mark.rotating(2)  # CI budget: tests/harness/rotation.py
def test_lost_nodes_shm_files_are_removed_by_the_survivors(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                                          dev_shm_dir: Path, baseline: FaultFree) -> None:
    """Issue 17: with --shm-dir and a spare agent, node 1 lost at step 6: the job ended well, but the
    dead node's files stayed in the shm dir after exit (GBs of RAM at real sizes). On one host the
    survivors share the directory: they remove a dead agent's group at the next generation, and the
    job leaves nothing behind. Rank 0 holds at step 8 (after the recovery) so the removal is seen
    while the job still runs, not only at its end."""
    c = new_cluster(module_etcd.endpoint, tmp_path, "nllost", REF_PAUSE_RANK="2", REF_PAUSE_STEP="6",
                    REF_PAUSE_RANK2="0", REF_PAUSE_STEP2="8", REF_PAUSE_RELEASE="release")
    shm = ("--shm-dir", str(dev_shm_dir))

    def files_of(node: str) -> list[str]:
        return [f.name for f in list_files(str(dev_shm_dir)) if f.node == node_tag(node)]

    try:
        c.start_leader_then_others(*shm)
        c.start_agent(*shm, "--spares", "2", nproc=0)
        c.paused_pid(2)
        victim = c.agent_of_rank(2)
        assert victim is not c.leader_agent()
        m0 = c.membership()
        assert m0 is not None
        lost_node = m0.worker_of(2).node_id
        wait_until(lambda: len(files_of(lost_node)) > 1, 60,
                   f"the victim node's replicas and own images in {dev_shm_dir}")
        os.kill(victim.pid, signal.SIGKILL)  # the whole node: agent and (by PDEATHSIG) its workers
        wait_membership(c, 1)
        c.paused_pid(0, "2")  # the job runs on, held here after the recovery
        wait_until(lambda: not files_of(lost_node), 20, f"the lost node's files gone from {dev_shm_dir} mid-job")
        assert list_files(str(dev_shm_dir)), "the live nodes' files went too"
        c.release("release2")
        c.wait(expect_fail=[victim])
    finally:
        c.kill_all()
    assert_bitwise_equal(c.finals(), baseline.finals)
    assert sorted(os.listdir(dev_shm_dir)) == [], "files left in the shm dir after the job"
