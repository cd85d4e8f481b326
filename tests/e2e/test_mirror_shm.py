"""Node-local /dev/shm peer store (issue 8): per-holder file names, re-attach after
SIGKILL, at-rest verification, owner records and cleanup. Real files, real processes.
A full /dev/shm and a lost node's files (issue 17): tests/e2e/test_node_local_shm.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptless.mirror.store as store_mod
from ckptless.errors import ConfigError, IntegrityError
from ckptless.mirror import MirrorConfig, MirrorEngine, cleanup_job, cleanup_stale, register_owner
from ckptless.mirror.reattach import attach
from ckptless.mirror.shm import (
    agent_alive, file_prefix, holder_files, list_files, node_tag, owner_record_path, parse_name,
    process_start_time, read_owner, slot_path,
)
from ckptless.mirror.store import PeerStore

from ..harness.mirror import init_gloo, start_and_join
from ..harness.shm import CHUNK, JOB, holder_files_of, make_image, run_py


# --- names ------------------------------------------------------------------------------------------
def test_two_holders_of_one_owner_share_a_directory_without_collision(shm_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 8, K=2 on one host: holders 2 and 3 of owner 1 complete the same round at once.

    Holder 3 finishes between holder 2's manifest temp write and its rename
    (the interleaving that raised ENOENT on ``...-o1-s0.json.tmp`` when both
    used one file name); with per-holder names both complete and keep their own files.
    """
    a = PeerStore(JOB, shm_dir=shm_dir, holder=2, node="host")
    b = PeerStore(JOB, shm_dir=shm_dir, holder=3, node="host")
    m, buf = make_image(1, 1)
    a.begin(m).copy_(buf)
    b.begin(m).copy_(buf)
    real_replace = os.replace

    def interleaved(src: str, dst: str) -> None:
        monkeypatch.setattr(os, "replace", real_replace)
        b.complete(1, verified=True)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", interleaved)
    a.complete(1, verified=True)
    monkeypatch.setattr(os, "replace", real_replace)
    names_a = {f.name for f in holder_files(shm_dir, JOB, "host", 2)}
    names_b = {f.name for f in holder_files(shm_dir, JOB, "host", 3)}
    assert len(names_a) == len(names_b) == 2 and not names_a & names_b
    assert set(os.listdir(shm_dir)) == names_a | names_b  # no temp file left behind
    # The next round of holder 3 alone never touches holder 2's complete image.
    m2, buf2 = make_image(1, 2)
    b.begin(m2)[:10].copy_(buf2[:10])
    for holder, want in ((2, [1]), (3, [1])):
        t = attach(shm_dir, JOB, holder=holder, node="host")
        assert t.versions(1) == want and not t.rejected
        assert t.verified_replicas() == [(1, 1, len(m.chunk_checksums))]
        assert torch.equal(t.get(1, 1).buffer, buf)  # type: ignore[union-attr]


def test_file_backed_store_requires_holder(shm_dir: str) -> None:
    with pytest.raises(ConfigError) as ei:
        PeerStore(JOB, shm_dir=shm_dir)
    assert ei.value.field == "holder"
    PeerStore(JOB)  # in memory: no identity needed


@settings(max_examples=200, deadline=None)
@given(jobs=st.lists(st.text(min_size=1, max_size=60), min_size=2, max_size=2, unique=True),
       node=st.one_of(st.none(), st.text(max_size=30)), owner=st.integers(0, 4096), holder=st.integers(0, 4096),
       slot=st.integers(0, 1), ext=st.sampled_from(["bin", "json"]))
def test_names_parse_back_to_their_job_and_identity(jobs: list[str], node: str | None, owner: int, holder: int,
                                                    slot: int, ext: str) -> None:
    job, other = jobs
    f = parse_name(os.path.basename(slot_path("/x", job, node, owner, holder, slot, ext)))
    assert f is not None and (f.job, f.node, f.owner, f.holder, f.slot, f.kind) == (
        file_prefix(job), node_tag(node), owner, holder, slot, ext)
    rec = parse_name(os.path.basename(owner_record_path("/x", job, node)))
    assert rec is not None and rec.kind == "owner" and rec.group == f.group
    if file_prefix(job) != file_prefix(other):
        g = parse_name(os.path.basename(slot_path("/x", other, node, owner, holder, slot, ext)))
        assert g is not None and g.job != f.job


# --- a real K=2 engine on one host --------------------------------------------------------------------
def _engine_worker(rank: int, world: int, tmp: str, shm_dir: str, rounds: int) -> None:
    out: dict[str, Any] = {}
    try:
        init_gloo(rank, world, os.path.join(tmp, "store"))
        cfg = MirrorConfig.build(replicas=2, chunk_bytes=CHUNK, wire_bytes=4 * CHUNK, timeout_s=30.0, shm_dir=shm_dir)
        eng = MirrorEngine(dist.new_group(backend="gloo"), JOB, cfg, node_of=["host"] * world)
        for v in range(1, rounds + 1):
            m, buf = make_image(rank, v, nbytes=64 * 1024 + rank, job=JOB)
            b = eng.acquire_buffer(m.total_bytes, timeout=30)
            b[: m.total_bytes].copy_(buf)
            eng.submit(m, b)
        eng.wait_idle(60)
        out = {"committed": eng.committed_version, "error": None if eng.error is None else repr(eng.error),
               "verified": eng.store.verified_replicas()}
        eng.close()
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        out["error"] = traceback.format_exc()
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)


def test_engine_k2_on_one_host_mirrors_cleanly_and_leaves_per_holder_files(tmp_path: Path, shm_dir: str) -> None:
    world, rounds = 3, 25
    start_and_join(_engine_worker, [(r, world, str(tmp_path), shm_dir, rounds) for r in range(world)])
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    for r, res in enumerate(results):
        assert res["error"] is None, res["error"]
        assert res["committed"] == rounds
        owners = [o for o in range(world) if o != r]
        assert sorted({o for o, _, _ in res["verified"]}) == owners
    # Every holder re-attaches exactly its own, bitwise-correct replicas, then removes them.
    for h in range(world):
        t = attach(shm_dir, JOB, holder=h, node="host")
        assert not t.rejected and t.owners() == [o for o in range(world) if o != h]
        for o in t.owners():
            img = t.latest(o)
            assert img is not None and img.manifest.version == rounds
            assert torch.equal(img.buffer, make_image(o, rounds, nbytes=64 * 1024 + o)[1])
        t.close(unlink=True)
    assert os.listdir(shm_dir) == []


# --- restart ------------------------------------------------------------------------------------------
def test_sigkilled_holder_reattached_by_new_process_finds_exactly_its_own(shm_dir: str) -> None:
    other = PeerStore(JOB, shm_dir=shm_dir, holder=3, node="host")  # a live neighbour holding owner 1 too
    other.put(*make_image(1, 5))
    child = run_py(f"""
        import os, signal
        from tests.harness.shm import make_image, JOB
        from ckptless.mirror.store import PeerStore
        s = PeerStore(JOB, shm_dir={shm_dir!r}, holder=2, node="host")
        for v in (1, 2):
            s.put(*make_image(0, v)); s.put(*make_image(1, v))
        m3, b3 = make_image(0, 3)
        s.begin(m3)[:1000].copy_(b3[:1000])  # killed mid-write: the slot of owner 0 v1 is gone
        open(s.files.path(1, 0, "json") + ".tmp", "wb").write(b"partial")  # and mid-rename of a manifest
        os.kill(os.getpid(), signal.SIGKILL)
        """)
    assert child.returncode == -signal.SIGKILL, child.stderr
    probe = run_py(f"""
        import json
        from ckptless.mirror.reattach import attach
        from tests.harness.shm import JOB
        t = attach({shm_dir!r}, JOB, holder=2, node="host")
        print(json.dumps({{"verified": t.verified_replicas(), "rejected": t.rejected}}))
        """)
    assert probe.returncode == 0, probe.stderr
    got = json.loads(probe.stdout)
    n = len(make_image(0, 1)[0].chunk_checksums)
    assert got["verified"] == [[0, 2, n], [1, 1, n], [1, 2, n]] and got["rejected"] == []
    assert not any(f.tmp for f in list_files(shm_dir))  # attach removed the crashed write's temp file
    assert attach(shm_dir, JOB, holder=3, node="host").verified_replicas() == [(1, 5, n)]
    assert attach(shm_dir, JOB, holder=2, node="elsewhere").owners() == []


def test_fresh_store_discards_what_its_predecessor_left(shm_dir: str) -> None:
    s = PeerStore(JOB, shm_dir=shm_dir, holder=1, node="host")
    s.put(*make_image(0, 1))
    keep = PeerStore(JOB, shm_dir=shm_dir, holder=2, node="host")
    keep.put(*make_image(0, 1))
    PeerStore(JOB, shm_dir=shm_dir, holder=1, node="host")  # not attach: starts empty, on disk too
    assert holder_files(shm_dir, JOB, "host", 1) == []
    assert attach(shm_dir, JOB, holder=2, node="host").versions(0) == [1]


def test_close_unlink_removes_this_holders_files_only(shm_dir: str) -> None:
    a = PeerStore(JOB, shm_dir=shm_dir, holder=1, node="host")
    b = PeerStore(JOB, shm_dir=shm_dir, holder=2, node="host")
    for s in (a, b):
        s.put(*make_image(0, 1))
        s.put(*make_image(0, 2))
    a.close(unlink=True)
    assert holder_files(shm_dir, JOB, "host", 1) == []
    assert len(holder_files(shm_dir, JOB, "host", 2)) == 4
    b.close(unlink=True)
    assert os.listdir(shm_dir) == []


# --- at-rest verification -------------------------------------------------------------------------------
def test_bit_flip_at_rest_is_not_reported_and_can_be_dropped(shm_dir: str) -> None:
    s = PeerStore(JOB, shm_dir=shm_dir, holder=2, node="host")
    imgs = {(o, v): make_image(o, v) for o in (0, 1) for v in (1, 2)}
    for m, b in imgs.values():
        s.put(m, b)
    n = len(imgs[(0, 1)][0].chunk_checksums)
    assert s.verified_replicas() == [(0, 1, n), (0, 2, n), (1, 1, n), (1, 2, n)]
    time.sleep(0.05)  # coarse file timestamps: let the stray write land in a later tick
    path = slot_path(shm_dir, JOB, "host", 1, 2, 1, "bin")  # owner 1 v2 is in slot 1
    flip = run_py(f"""
        f = open({path!r}, "r+b"); f.seek(20_000); b = f.read(1); f.seek(20_000); f.write(bytes([b[0] ^ 0x10]))
        """)
    assert flip.returncode == 0, flip.stderr
    assert os.path.getsize(path) == 50_000  # same size: only the checksums can tell
    assert s.verified_replicas() == [(0, 1, n), (0, 2, n), (1, 1, n)]
    assert s.check_at_rest().corrupt == [(1, 2, [20_000 // CHUNK])]
    with pytest.raises(IntegrityError):
        s.verify(1, 2)
    assert s.drop(1, 2) and not s.drop(1, 2)
    assert s.versions(1) == [1] and s.check_at_rest().corrupt == []
    assert attach(shm_dir, JOB, holder=2, node="host").versions(1) == [1]  # not re-attached either
    # Repaired from another holder: the same (owner, version) is accepted again.
    s.put(*imgs[(1, 2)])
    assert (1, 2, n) in s.verified_replicas()


def test_verdicts_are_cached_and_in_memory_rot_needs_a_forced_recheck(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = store_mod.bad_held_chunks

    def counting(*a: Any, **kw: Any) -> list[int]:
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(store_mod, "bad_held_chunks", counting)
    s = PeerStore(JOB)
    m, b = make_image(0, 1)
    s.begin(m).copy_(b)
    s.complete(0, verified=True)  # the transport verified on receipt
    assert s.verified_replicas() == [(0, 1, len(m.chunk_checksums))] and calls == []
    s.latest(0).buffer[5] ^= 1  # type: ignore[union-attr]  # rot no stat can see
    assert s.verified_replicas() != [] and calls == []
    assert s.verified_replicas(max_age_s=0) == [] and len(calls) == 1
    assert s.check_at_rest().corrupt == [(0, 1, [0])] and len(calls) == 1  # corrupt verdict kept until drop


def test_check_racing_with_a_rewrite_reports_neither_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    s = PeerStore(JOB)
    for v in (1, 2):
        s.put(*make_image(0, v))
    real = store_mod.bad_held_chunks
    m3, b3 = make_image(0, 3)

    def rewrite_meanwhile(*a: Any, **kw: Any) -> list[int]:
        monkeypatch.setattr(store_mod, "bad_held_chunks", real)
        s.begin(m3)[:10].copy_(b3[:10])  # the next round reuses v1's slot mid-check
        return real(*a, **kw)

    monkeypatch.setattr(store_mod, "bad_held_chunks", rewrite_meanwhile)
    res = s.check_at_rest(max_age_s=0)
    assert [v for _, v, _ in res.verified] == [2] and res.corrupt == []


# --- owner records and cleanup ----------------------------------------------------------------------------
def test_cleanup_job_leaves_other_jobs_files(shm_dir: str) -> None:
    for job in ("a", "a-b", "zz"):
        for node in ("n0", "n1"):
            register_owner(shm_dir, job, node=node)
            holder_files_of(shm_dir, job, node)
    open(os.path.join(shm_dir, "unrelated.bin"), "wb").close()
    open(os.path.join(shm_dir, file_prefix("a") + "-o1-s0.json"), "wb").close()  # pre-issue-8 name
    removed = cleanup_job(shm_dir, "a", only_node="n1")
    assert len(removed) == 3 and all(parse_name(os.path.basename(p)).node == node_tag("n1") for p in removed)  # type: ignore[union-attr]
    assert len(cleanup_job(shm_dir, "a")) == 4
    left = list_files(shm_dir)
    assert {f.job for f in left} == {file_prefix("a-b"), file_prefix("zz")} and len(left) == 12
    assert "unrelated.bin" in os.listdir(shm_dir)


def test_cleanup_stale_removes_dead_agents_files_and_keeps_live_ones(shm_dir: str) -> None:
    # The dead agent: a real process that registers, writes a holder's files, and exits.
    dead = run_py(f"""
        from ckptless.mirror import register_owner
        from tests.harness.shm import holder_files_of
        register_owner({shm_dir!r}, "deadjob", node="n0")
        holder_files_of({shm_dir!r}, "deadjob", "n0")
        """)
    assert dead.returncode == 0, dead.stderr
    # A live agent (this process) and a live agent in another process.
    register_owner(shm_dir, "livejob", node="n0")
    holder_files_of(shm_dir, "livejob", "n0")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        register_owner(shm_dir, "sleepjob", sleeper.pid, node="n1")
        holder_files_of(shm_dir, "sleepjob", "n1")
        # A record whose pid is alive but was reused by another process (start time differs).
        reused = register_owner(shm_dir, "reusedjob", node="n0")
        doc = json.loads(Path(reused).read_text())
        doc["start_time"] = (doc["start_time"] or 0) - 1
        Path(reused).write_text(json.dumps(doc))
        holder_files_of(shm_dir, "reusedjob", "n0")
        # Orphans (no record): kept by default, and kept even with a grace when the job is alive.
        holder_files_of(shm_dir, "orphanjob", "n9")
        holder_files_of(shm_dir, "livejob", "n9")

        removed = {os.path.basename(p) for p in cleanup_stale(shm_dir)}
        assert {parse_name(n).job for n in removed} == {file_prefix("deadjob"), file_prefix("reusedjob")}  # type: ignore[union-attr]
        assert len(removed) == 6  # bin + json + owner record, twice
        jobs = {f.job for f in list_files(shm_dir)}
        assert jobs == {file_prefix(j) for j in ("livejob", "sleepjob", "orphanjob")}
        orphans = {f.name for f in list_files(shm_dir) if f.job == file_prefix("orphanjob")}
        assert len(orphans) == 2 and {os.path.basename(p) for p in cleanup_stale(shm_dir, orphan_grace_s=0)} == orphans
        # The sleeping agent dies; unreaped, it is a zombie, which counts as dead.
        sleeper.kill()
        deadline = time.monotonic() + 10
        while process_start_time(sleeper.pid) is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not agent_alive(sleeper.pid, read_owner(owner_record_path(shm_dir, "sleepjob", "n1")).start_time)  # type: ignore[union-attr]
        assert len(cleanup_stale(shm_dir)) == 3
    finally:
        sleeper.kill()
        sleeper.wait()
    assert {f.job for f in list_files(shm_dir)} == {file_prefix("livejob")}
    assert cleanup_stale(shm_dir, orphan_grace_s=0) == []  # livejob's n9 orphan: its job is alive here
