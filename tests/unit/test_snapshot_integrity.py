"""Snapshot choice verifies content: same-size corruption anywhere is caught, older snapshots are used.

Real files and real DCP saves through SnapshotWriter; corruption is done by
rewriting bytes on disk. Issue 8: a same-size bit flip in the newest
snapshot made the leader pick it again and again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptless.errors import IntegrityError, SnapshotError
from ckptless.snapshot import (
    MARKER, SnapshotInfo, SnapshotIntegrityError, choose_snapshot, forget_verified, latest_complete,
    list_complete, load_snapshot, step_dir, verify_snapshot,
)
from ckptless.snapshot import integrity

from ..harness.snapshot_job import JOB, Job, run_and_snapshot

# --- helpers ---------------------------------------------------------------------


def three_snapshots(tmp: Path) -> Path:
    """Steps 2, 4, 6 of one job, all complete and valid."""
    _, w = run_and_snapshot(tmp, 6, keep=3)
    assert w.last_checksum_s > 0
    w.close()
    return tmp / "snaps"


def data_file(sdir: Path, rank: int = 0) -> Path:
    return next((sdir / f"rank{rank}").glob("*.distcp"))


def flip(path: Path, offset: int | None = None, xor: int = 0xFF) -> None:
    """Change one byte in place (same size)."""
    raw = bytearray(path.read_bytes())
    at = len(raw) // 2 if offset is None else offset
    raw[at] ^= xor
    with open(path, "r+b") as f:  # rewrite in place: same inode, same size
        f.write(raw)
    assert path.stat().st_size == len(raw)


def swap_digit(path: Path, after: str) -> None:
    """Change the last digit of the first number after ``after``: still valid JSON, same size."""
    raw = path.read_bytes()
    m = re.compile(re.escape(after.encode()) + rb"[^0-9]*[0-9]*([0-9])").search(raw)
    assert m is not None, after
    i = m.start(1)
    flip(path, i, 0x01 if raw[i] != ord("9") else 0x08)  # '0'<->'1', '9'->'1'
    json.loads(path.read_bytes())


def protected(job: Job) -> dict[str, Any]:
    """Everything a restore could touch, cloned."""
    opt = {(i, k): v.clone() for i, s in job.opt.state_dict()["state"].items() for k, v in s.items()}
    return {"params": [p.detach().clone() for p in job.model.parameters()], "opt": opt,
            "sched": job.sched.state_dict(), "index": job.data.index, "rng": torch.get_rng_state()}


def assert_unchanged(before: dict[str, Any], job: Job) -> None:
    now = protected(job)
    assert all(torch.equal(a, b) for a, b in zip(before["params"], now["params"]))
    assert before["opt"].keys() == now["opt"].keys()
    assert all(torch.equal(v, now["opt"][k]) for k, v in before["opt"].items())
    assert before["sched"] == now["sched"] and before["index"] == now["index"]
    assert torch.equal(before["rng"], now["rng"])


# --- one corrupt byte in each kind of file of the newest snapshot ---------------------


def corrupt_data(s: Path) -> str:
    flip(data_file(s))
    return "files.__0_0.distcp.crc32c"


def corrupt_metadata(s: Path) -> str:
    flip(s / "rank0" / ".metadata", xor=0x01)
    return "files..metadata.crc32c"


def corrupt_part(s: Path) -> str:
    swap_digit(s / "rank0.json", '"chunk_checksums":[')
    return "ranks[0].part_sha256"


def corrupt_marker_value(s: Path) -> str:
    swap_digit(s / MARKER, '"wall_time":')  # nothing else in the marker could tell
    return "marker_sha256"


def corrupt_marker_whitespace(s: Path) -> str:
    raw = (s / MARKER).read_bytes()
    (s / MARKER).write_bytes(raw.replace(b"\n", b" ", 1))  # still valid JSON, same size
    json.loads((s / MARKER).read_bytes())
    return "canonical form"


CORRUPTIONS = [corrupt_data, corrupt_metadata, corrupt_part, corrupt_marker_value, corrupt_marker_whitespace]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__)
def test_corrupt_newest_falls_back_to_older(tmp_path: Path, corrupt: Any) -> None:
    snaps = three_snapshots(tmp_path)
    s6 = step_dir(snaps, JOB, 6)
    assert choose_snapshot(snaps, JOB, 1)[0] is not None  # caches a "valid" verdict for step 6 ...
    time.sleep(0.02)  # ... which the corruption's new ctime/mtime must invalidate
    field = corrupt(s6)

    info, rejected = choose_snapshot(snaps, JOB, 1)
    assert info is not None and info.step == 4
    assert [s for s, _ in rejected] == [6]
    reason = rejected[0][1]
    assert field in reason and str(s6) in reason and "(step 6)" in reason
    assert latest_complete(snaps, JOB, 1) == info
    assert [i.step for i in list_complete(snaps, JOB, 1)] == [4, 2]

    fresh = Job(seed=11)
    assert load_snapshot(info, fresh.reg, 0) == 4 and fresh.data.index == 4


def test_all_snapshots_corrupt_gives_none_with_reasons(tmp_path: Path) -> None:
    snaps = three_snapshots(tmp_path)
    corrupt_data(step_dir(snaps, JOB, 6))
    corrupt_part(step_dir(snaps, JOB, 4))
    corrupt_marker_value(step_dir(snaps, JOB, 2))
    info, rejected = choose_snapshot(snaps, JOB, 1)
    assert info is None
    assert [s for s, _ in rejected] == [6, 4, 2]
    assert "crc32c" in rejected[0][1] and "part_sha256" in rejected[1][1] and "marker_sha256" in rejected[2][1]
    assert latest_complete(snaps, JOB, 1) is None and list_complete(snaps, JOB, 1) == []


def test_truncated_and_missing_files(tmp_path: Path) -> None:
    snaps = three_snapshots(tmp_path)
    s6, s4, s2 = (step_dir(snaps, JOB, s) for s in (6, 4, 2))
    d = data_file(s6)
    with open(d, "r+b") as f:
        f.truncate(d.stat().st_size - 1)
    (s4 / "rank0" / ".metadata").unlink()
    info, rejected = choose_snapshot(snaps, JOB, 1)
    assert info is not None and info.step == 2
    assert [s for s, _ in rejected] == [6, 4]
    assert "truncated" in rejected[0][1] and "files.__0_0.distcp.size" in rejected[0][1]
    assert "missing" in rejected[1][1] and ".metadata" in rejected[1][1]

    (s2 / "rank0.json").unlink()
    info, rejected = choose_snapshot(snaps, JOB, 1)
    assert info is None and "rank0.json missing" in rejected[2][1]


def test_incomplete_and_excluded_are_listed_and_skipped(tmp_path: Path) -> None:
    snaps = three_snapshots(tmp_path)
    (step_dir(snaps, JOB, 6) / MARKER).unlink()
    info, rejected = choose_snapshot(snaps, JOB, 1, exclude={4})
    assert info is not None and info.step == 2
    assert [s for s, _ in rejected] == [6, 4]
    assert "incomplete" in rejected[0][1] and "excluded" in rejected[1][1]
    other, why = choose_snapshot(snaps, JOB, 2)  # another world size: nothing is chosen
    assert other is None and [s for s, _ in why] == [6, 4, 2] and "field world_size=1" in why[1][1]
    assert choose_snapshot(tmp_path / "nowhere", JOB, 1) == (None, [])


# --- load verifies too, and leaves the objects alone ------------------------------------


@pytest.mark.parametrize("corrupt", [corrupt_data, corrupt_metadata, corrupt_part], ids=lambda f: f.__name__)
def test_load_of_corrupt_snapshot_raises_typed_error_and_changes_nothing(tmp_path: Path, corrupt: Any) -> None:
    snaps = three_snapshots(tmp_path)
    s6 = step_dir(snaps, JOB, 6)
    info = verify_snapshot(s6, JOB, 1, verify_content=True)  # chosen while it was valid
    corrupt(s6)
    fresh = Job(seed=5)
    fresh.step()  # optimizer state exists, so there is something to overwrite
    before = protected(fresh)
    with pytest.raises(SnapshotIntegrityError) as ei:
        load_snapshot(info, fresh.reg, 0)
    err = ei.value
    assert isinstance(err, IntegrityError) and isinstance(err, SnapshotError)
    assert err.step == 6 and err.path is not None and str(err.path) in str(err) and "(step 6)" in str(err)
    assert err.path.parent in (s6, s6 / "rank0")
    assert_unchanged(before, fresh)


def test_restore_never_loops(tmp_path: Path) -> None:
    """The leader's loop: choose, load, exclude what failed. Each step is tried at most once."""
    snaps = three_snapshots(tmp_path)
    chosen = choose_snapshot(snaps, JOB, 1)[0]
    assert chosen is not None and chosen.step == 6  # verdict cached as valid
    time.sleep(0.02)
    flip(data_file(step_dir(snaps, JOB, 6)))
    os.utime(data_file(step_dir(snaps, JOB, 6)), ns=(0, 0))  # even with the mtime faked, ctime moved

    failed: set[int] = set()
    tried: list[int] = []
    fresh = Job(seed=3)
    for _ in range(50):
        info, _rej = choose_snapshot(snaps, JOB, 1, exclude=failed)
        assert info is not None
        tried.append(info.step)
        try:
            load_snapshot(info, fresh.reg, 0)
            break
        except SnapshotError:
            failed.add(info.step)
    assert tried == [4]
    assert len(tried) == len(set(tried))


# --- verdict cache -----------------------------------------------------------------


def test_verdicts_are_cached_until_a_file_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    snaps = three_snapshots(tmp_path)
    reads: list[Path] = []
    real = integrity.file_sum

    def counting(path: Path) -> integrity.FileSum:
        reads.append(path)
        return real(path)

    monkeypatch.setattr(integrity, "file_sum", counting)
    forget_verified()
    assert choose_snapshot(snaps, JOB, 1)[0] is not None
    first = len(reads)
    assert first == 2  # step 6 only: .metadata and the data file; older ones are not read
    for _ in range(3):
        assert choose_snapshot(snaps, JOB, 1)[0] is not None
    assert len(reads) == first  # cached: only stat()s
    os.utime(data_file(step_dir(snaps, JOB, 6)))  # metadata change: re-read, still valid
    assert choose_snapshot(snaps, JOB, 1)[0] is not None and len(reads) == 2 * first
    forget_verified(step_dir(snaps, JOB, 6))
    assert choose_snapshot(snaps, JOB, 1)[0] is not None and len(reads) == 3 * first
    # negative verdicts are cached too, as fresh copies of the error
    corrupt_data(step_dir(snaps, JOB, 6))
    r1 = choose_snapshot(snaps, JOB, 1)[1]
    n = len(reads)
    assert choose_snapshot(snaps, JOB, 1)[1] == r1 and len(reads) == n


# --- old format ---------------------------------------------------------------------


def downgrade_to_format1(sdir: Path) -> None:
    """Rewrite a snapshot's records the way format 1 wrote them (sizes only, no marker digest)."""
    part = sdir / "rank0.json"
    doc = json.loads(part.read_bytes())
    doc["format"] = 1
    doc["files"] = {k: v["size"] for k, v in doc["files"].items()}
    part.write_bytes(json.dumps(doc, separators=(",", ":")).encode())
    marker = json.loads((sdir / MARKER).read_bytes())
    del marker["marker_sha256"]
    marker["format"] = 1
    marker["ranks"][0]["part_sha256"] = hashlib.sha256(part.read_bytes()).hexdigest()
    (sdir / MARKER).write_bytes(json.dumps(marker, indent=1).encode())


def test_format1_snapshot_is_rejected_by_content_check_and_loadable_on_sizes(tmp_path: Path) -> None:
    snaps = three_snapshots(tmp_path)
    s6 = step_dir(snaps, JOB, 6)
    downgrade_to_format1(s6)
    info, rejected = choose_snapshot(snaps, JOB, 1)
    assert info is not None and info.step == 4
    assert rejected[0][0] == 6 and "field format=1" in rejected[0][1] and "per-file checksums" in rejected[0][1]

    old = latest_complete(snaps, JOB, 1, verify_content=False)
    assert old is not None and old.step == 6 and old.format == 1
    fresh = Job(seed=9)
    assert load_snapshot(old, fresh.reg, 0) == 6 and fresh.data.index == 6
    flip(data_file(s6))
    with pytest.raises(SnapshotError):  # format 1: caught by the manifest CRCs (or DCP) after the read
        load_snapshot(old, fresh.reg, 0)


# --- any single-byte change anywhere is rejected -------------------------------------------


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    base = tmp_path_factory.mktemp("template")
    _, w = run_and_snapshot(base, 4, keep=2)
    w.close()
    yield base / "snaps"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_byte_change_in_newest_is_rejected(template: Path, data: st.DataObject) -> None:
    work = Path(tempfile.mkdtemp(dir=template.parent))
    try:
        snaps = work / "snaps"
        shutil.copytree(template, snaps)
        s4 = step_dir(snaps, JOB, 4)
        files = sorted(p for p in s4.rglob("*") if p.is_file())
        target = data.draw(st.sampled_from(files), label="file")
        size = target.stat().st_size
        offset = data.draw(st.integers(0, size - 1), label="offset")
        xor = data.draw(st.integers(1, 255), label="xor")
        flip(target, offset, xor)
        info, rejected = choose_snapshot(snaps, JOB, 1)
        assert info is not None and info.step == 2, (target, offset, xor)
        assert rejected and rejected[0][0] == 4
        with pytest.raises(SnapshotError):
            verify_snapshot(s4, JOB, 1, verify_content=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_save_records_a_checksum_for_every_file(tmp_path: Path) -> None:
    snaps = three_snapshots(tmp_path)
    s6 = step_dir(snaps, JOB, 6)
    doc = json.loads((s6 / "rank0.json").read_bytes())
    on_disk = {p.name for p in (s6 / "rank0").iterdir()}
    assert doc["format"] == 2 and set(doc["files"]) == on_disk and ".metadata" in on_disk
    for name, ent in doc["files"].items():
        assert integrity.file_sum(s6 / "rank0" / name) == integrity.FileSum(ent["size"], ent["crc32c"])
    marker = json.loads((s6 / MARKER).read_bytes())
    assert marker["format"] == 2 and isinstance(marker["marker_sha256"], str)
    assert isinstance(verify_snapshot(s6, JOB, 1, verify_content=True), SnapshotInfo)
