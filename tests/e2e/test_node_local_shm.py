"""A full ``/dev/shm`` and a lost node's files (issue 17), at the level of the peer store, the own
image files and the owner records. Real files and processes; a real tiny tmpfs where root may
mount one (those tests skip elsewhere, and one monkeypatched twin runs everywhere).

Was: a full ``--shm-dir`` made every mirror round time out, forever (sparse slot files failed only
on the first write into their mapping), and a lost node's files outlived the job on a shared host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckptless.errors import ConfigError
from ckptless.mirror import cleanup_stale, register_owner
from ckptless.mirror.reattach import attach
from ckptless.mirror.shm import file_prefix, finish_job, list_files, node_tag, parse_name, remove_dead_groups, slot_path
from ckptless.mirror.store import PeerStore

from ..harness.shm import JOB, holder_files_of, make_image, mounted_tmpfs, run_py


# --- a full /dev/shm (issue 17) ---------------------------------------------------------------------------
@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[str]:
    """A real 256 KiB tmpfs of its own (root only; skipped where mount is not allowed), unmounted afterwards."""
    d = tmp_path / "tiny"
    d.mkdir()
    with mounted_tmpfs(d, "256k"):
        yield str(d)


def free_bytes(d: str) -> int:
    st = os.statvfs(d)
    return st.f_bavail * st.f_frsize


def fill(d: str, leave: int = 0, name: str = "filler") -> None:
    """Take every free byte of ``d`` but ``leave`` (a file of reserved pages, not one of ours)."""
    fd = os.open(os.path.join(d, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, free_bytes(d) - leave)
    finally:
        os.close(fd)
    assert free_bytes(d) <= leave


def fallback_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "ckptless.mirror.shm" and r.levelname == "WARNING"]


def test_full_shm_from_the_start_holds_replicas_in_memory_and_says_so_once(
        tiny_tmpfs: str, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 17: the payload files used to be sparse, so a full tmpfs failed only at the first write
    into the mapping (SIGBUS here; in a round a Gloo receive that never completed: every round timed
    out, forever). Now the slot falls back to memory, the round's image completes, and one warning
    names the directory, ENOSPC and the bytes needed."""
    fill(tiny_tmpfs)
    s = PeerStore(JOB, shm_dir=tiny_tmpfs, holder=2, node="host")
    caplog.set_level("WARNING", logger="ckptless.mirror.shm")
    for v in (1, 2, 3):
        for o in (0, 1):
            m, buf = make_image(o, v)
            assert s.put(m, buf) == m
            img = s.latest(o)
            assert img is not None and torch.equal(img.buffer, buf)
    n = len(make_image(0, 1)[0].chunk_checksums)
    assert s.verified_replicas(max_age_s=0) == [(o, v, n) for o in (0, 1) for v in (2, 3)]
    (msg,) = fallback_warnings(caplog)
    assert "ENOSPC" in msg and tiny_tmpfs in msg and "50000 bytes" in msg and "holder rank 2" in msg, msg
    assert list_files(tiny_tmpfs) == []  # nothing half-made is left to mislead a re-attach
    assert attach(tiny_tmpfs, JOB, holder=2, node="host").owners() == []


def test_shm_filling_up_mid_job_moves_only_the_grown_slot_to_memory(
        tiny_tmpfs: str, caplog: pytest.LogCaptureFixture) -> None:
    """A later, bigger version that no longer fits: that slot goes to memory (one warning), the
    other slot stays in its file, and every later allocation tries the directory again."""
    s = PeerStore(JOB, shm_dir=tiny_tmpfs, holder=2, node="host")
    for v in (1, 2):
        s.put(*make_image(0, v))
    fill(tiny_tmpfs, leave=8192)
    caplog.set_level("WARNING", logger="ckptless.mirror.shm")
    m3, b3 = make_image(0, 3, nbytes=100_000)
    s.put(m3, b3)  # v1's slot must grow by 50 KB: no room, so it moves to memory (and frees its file)
    img = s.latest(0)
    assert img is not None and img.manifest.version == 3 and torch.equal(img.buffer, b3)
    assert {(f.slot, f.kind) for f in list_files(tiny_tmpfs)} == {(1, "bin"), (1, "json")}
    assert attach(tiny_tmpfs, JOB, holder=2, node="host").versions(0) == [2]  # a respawn finds v2
    m4, b4 = make_image(0, 4, nbytes=100_000)
    s.put(m4, b4)  # v2's slot grows in place, into the pages v1's file gave back: a file again
    assert s.versions(0) == [3, 4] and torch.equal(s.get(0, 4).buffer, b4)  # type: ignore[union-attr]
    (msg,) = fallback_warnings(caplog)
    assert "ENOSPC" in msg and "100000 bytes" in msg and "replica of owner 0" in msg, msg
    t = attach(tiny_tmpfs, JOB, holder=2, node="host")
    assert t.versions(0) == [4] and not t.rejected


def test_manifest_that_does_not_fit_costs_the_reattach_not_the_round(
        tiny_tmpfs: str, caplog: pytest.LogCaptureFixture) -> None:
    """The payload's pages fit exactly, its manifest file does not: the image is complete and held
    (in its file), only a respawned holder will not find it. Before, the OSError broke the round."""
    s = PeerStore(JOB, shm_dir=tiny_tmpfs, holder=2, node="host")
    caplog.set_level("WARNING", logger="ckptless.mirror.shm")
    m, buf = make_image(0, 1, nbytes=free_bytes(tiny_tmpfs))
    assert s.put(m, buf) == m
    img = s.latest(0)
    assert img is not None and torch.equal(img.buffer, buf)
    (msg,) = fallback_warnings(caplog)
    assert "ENOSPC" in msg and "manifest of owner 0's replica v1" in msg, msg
    assert [f.kind for f in list_files(tiny_tmpfs)] == ["bin"]  # no manifest, no temp file
    t = attach(tiny_tmpfs, JOB, holder=2, node="host")
    assert t.owners() == [] and not t.rejected  # an empty, reusable slot


def test_reattach_drops_a_sparse_slot_that_a_full_tmpfs_could_not_back(tiny_tmpfs: str) -> None:
    """A payload file with holes (written by an older version, or cut short) on a full tmpfs: mapping it
    as a reusable slot would SIGBUS the next write into a hole. It is rejected and removed instead."""
    m, buf = make_image(0, 1)
    Path(slot_path(tiny_tmpfs, JOB, "host", 0, 2, 0, "json")).write_bytes(m.to_bytes())
    bin_path = slot_path(tiny_tmpfs, JOB, "host", 0, 2, 0, "bin")
    open(bin_path, "wb").close()
    os.truncate(bin_path, 1 << 20)  # sparse: no page reserved
    fill(tiny_tmpfs)
    t = attach(tiny_tmpfs, JOB, holder=2, node="host")
    ((path, why),) = t.rejected
    assert path == bin_path and "ENOSPC" in why, t.rejected
    assert t.owners() == [] and list_files(tiny_tmpfs) == []
    t.put(m, buf)  # and the store goes on, in memory
    assert t.versions(0) == [1]


def test_full_directory_refuses_the_owner_record_with_one_clear_error(tiny_tmpfs: str) -> None:
    fill(tiny_tmpfs)
    with pytest.raises(ConfigError, match="ENOSPC") as exc:
        register_owner(tiny_tmpfs, "fulljob", node="n0")
    assert tiny_tmpfs in str(exc.value)
    assert os.listdir(tiny_tmpfs) == ["filler"]  # no temp record left behind


def test_unreservable_slot_falls_back_without_a_tmpfs_of_its_own(shm_dir: str, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """The same fallback where no tmpfs can be mounted (not root): the reservation says ENOSPC."""
    def full(fd: int, off: int, n: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    caplog.set_level("WARNING", logger="ckptless.mirror.shm")
    s = PeerStore(JOB, shm_dir=shm_dir, holder=1, node="host")
    for o in (0, 2):
        s.put(*make_image(o, 1))
    assert s.owners() == [0, 2] and list_files(shm_dir) == []
    (msg,) = fallback_warnings(caplog)
    assert "ENOSPC (No space left on device)" in msg and shm_dir in msg, msg
    assert s.fallback.reason.startswith("ENOSPC")


# --- a lost node's files on a shared host (issue 17) ----------------------------------------------------------
def _dead_agent(shm_dir: str, job: str, node: str) -> None:
    """A real agent process that registers, leaves a holder's files and an own image, and exits."""
    dead = run_py(f"""
        from ckptless.mirror import register_owner
        from ckptless.mirror.ownimage import OwnImageFiles
        from tests.harness.shm import holder_files_of
        register_owner({shm_dir!r}, {job!r}, node={node!r})
        holder_files_of({shm_dir!r}, {job!r}, {node!r})
        OwnImageFiles({shm_dir!r}, {job!r}, {node!r}, 3).allocate(10_000)
        """)
    assert dead.returncode == 0, dead.stderr


def _groups(shm_dir: str) -> set[tuple[str, str | None]]:
    return {(f.job, f.node) for f in list_files(shm_dir)}


def test_finish_job_removes_its_own_and_dead_nodes_files_of_the_job_only(shm_dir: str) -> None:
    """Issue 17: node 1 lost at step 5, the job ends well, and its files stayed in the shm dir after exit.
    An agent's exit now takes its own group and every group of the job whose agent is dead; a live
    agent's group (it is still running) and another job's dead group (its own business, removed by
    the next start-up sweep) stay."""
    _dead_agent(shm_dir, "job", "lost")
    _dead_agent(shm_dir, "otherjob", "n0")
    register_owner(shm_dir, "job", node="me")
    holder_files_of(shm_dir, "job", "me")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        register_owner(shm_dir, "job", sleeper.pid, node="alive")
        holder_files_of(shm_dir, "job", "alive")
        removed = finish_job(shm_dir, "job", "me")
        assert {parse_name(os.path.basename(p)).node for p in removed} == {node_tag("me"), node_tag("lost")}  # type: ignore[union-attr]
        assert len(removed) == 3 + 4  # mine: bin, json, record; lost: bin, json, own buffer, record
        assert _groups(shm_dir) == {(file_prefix("job"), node_tag("alive")), (file_prefix("otherjob"), node_tag("n0"))}
        sleeper.kill()
        sleeper.wait()
        assert len(finish_job(shm_dir, "job", "alive")) == 3  # the last agent of the job leaves nothing of it
    finally:
        sleeper.kill()
        sleeper.wait()
    assert _groups(shm_dir) == {(file_prefix("otherjob"), node_tag("n0"))}


def test_remove_dead_groups_keeps_live_and_foreign_namespace_agents(shm_dir: str,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """What a surviving agent runs on every new generation: only groups whose recorded agent is dead go.
    A record written in another pid namespace (a container sharing /dev/shm) names a pid that means
    nothing here: it is never judged dead, not even as an old orphan."""
    _dead_agent(shm_dir, "job", "lost")
    register_owner(shm_dir, "job", node="me")
    holder_files_of(shm_dir, "job", "me")
    foreign = register_owner(shm_dir, "job", node="container")
    doc = json.loads(Path(foreign).read_text())
    assert doc["pid_ns"] and doc["pid_ns"].startswith("pid:")
    doc.update(pid=2 ** 22 + 17, start_time=1, pid_ns="pid:[1]")  # a pid that does not exist here
    Path(foreign).write_text(json.dumps(doc))
    holder_files_of(shm_dir, "job", "container")
    caplog.set_level("INFO", logger="ckptless.mirror.shm")
    removed = remove_dead_groups(shm_dir, "job")
    assert {parse_name(os.path.basename(p)).node for p in removed} == {node_tag("lost")}  # type: ignore[union-attr]
    assert any("dead node" in r.getMessage() and node_tag("lost") in r.getMessage() for r in caplog.records)
    assert remove_dead_groups(shm_dir, "job") == []
    assert cleanup_stale(shm_dir, orphan_grace_s=0) == []
    assert _groups(shm_dir) == {(file_prefix("job"), node_tag("me")), (file_prefix("job"), node_tag("container"))}


def test_remove_dead_groups_never_raises(shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """It runs on the agent's watch thread: a directory it cannot read is a warning, not a lost agent."""
    def unreadable(_d: str) -> list[str]:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "listdir", unreadable)
    assert remove_dead_groups(shm_dir, "job") == []
