"""ckptless.snapshot: DCP-format async snapshots, retention, verification, exact restore."""

from __future__ import annotations

import dataclasses
import errno
import logging
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptless.errors import ConfigError, DiskFullError, IntegrityError, SnapshotError
from ckptless.snapshot import (
    MARKER, SnapshotConfig, SnapshotEntry, SnapshotIntegrityError, SnapshotWriter, latest_complete, list_complete,
    load_snapshot, plan_retention, step_dir, verify_snapshot,
)
from ckptless.snapshot.reader import marker_bytes

from ..harness.repo import REPO, child_env
from ..harness.snapshot_job import JOB, Job, cfg, run_and_snapshot


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    assert a["opt"].keys() == b["opt"].keys()
    for i in a["opt"]:
        for k in a["opt"][i]:
            assert torch.equal(a["opt"][i][k], b["opt"][i][k]), (i, k)
    assert (a["lr"], a["index"], a["py"], a["np"]) == (b["lr"], b["index"], b["py"], b["np"])
    assert torch.equal(a["rand"], b["rand"])


# --- round trips ---------------------------------------------------------------


def test_single_process_round_trip_is_exact(tmp_path: Path) -> None:
    job, w = run_and_snapshot(tmp_path, 4, keep=3)
    assert w.last_complete is not None and w.last_complete.step == 4
    assert w.last_block_s > 0
    for _ in range(2):
        job.step()
    want = job.facts()

    fresh = Job(seed=123)
    info = latest_complete(tmp_path / "snaps", JOB, 1)
    assert info is not None and info.step == 4 and info.world_size == 1
    assert load_snapshot(info, fresh.reg, 0) == 4
    assert fresh.data.order == (3, 1, 2) and fresh.data.index == 4
    for _ in range(2):
        fresh.step()
    assert_same(fresh.facts(), want)
    assert [i.step for i in list_complete(tmp_path / "snaps", JOB, 1)] == [4, 2]
    w.close()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_plain_dcp_load_without_ckptless(tmp_path: Path) -> None:
    job, w = run_and_snapshot(tmp_path, 2)
    w.close()
    fresh = Job(seed=7)
    fresh.step()  # populate optimizer state so the request has every key
    sd = {"model": fresh.model.state_dict(), "optimizer": fresh.opt.state_dict()}
    dcp.load(sd, checkpoint_id=str(step_dir(tmp_path / "snaps", JOB, 2) / "rank0"), no_dist=True)
    fresh.opt.load_state_dict(sd["optimizer"])
    for a, b in zip(job.model.parameters(), fresh.model.parameters()):
        assert torch.equal(a, b)
    for i, st_ in job.opt.state_dict()["state"].items():
        for k, v in st_.items():
            assert torch.equal(v, fresh.opt.state_dict()["state"][i][k])
    assert fresh.opt.param_groups[0]["lr"] == job.opt.param_groups[0]["lr"]


def test_two_process_gloo_round_trip(tmp_path: Path) -> None:
    snaps, out = tmp_path / "snaps", tmp_path / "out"
    out.mkdir()

    def spawn(mode: str) -> None:
        store = tmp_path / f"store-{mode}"
        procs = [subprocess.Popen([sys.executable, "-m", "tests.harness.snapshot_workers", mode, str(r), "2",
                                   str(store), str(snaps), str(out)], cwd=REPO, env=child_env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(2)]
        try:
            logs = [p.communicate(timeout=90)[0].decode(errors="replace") for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        for p, log in zip(procs, logs):
            assert p.returncode == 0, log[-3000:]

    spawn("save")
    info = latest_complete(snaps, "gloo-job", 2)
    assert info is not None and info.step == 4
    assert latest_complete(snaps, "gloo-job", 4) is None  # other world size: never loaded
    spawn("load")
    res = {(m, r): torch.load(out / f"{m}_rank{r}.pt", weights_only=True) for m in ("save", "load") for r in (0, 1)}
    for r in (0, 1):
        ref, got = res["save", r], res["load", r]
        assert int(got["start"]) == 4 and ref.keys() == got.keys()
        for k in ref:
            if k != "start":
                assert torch.equal(ref[k], got[k]), (r, k)
    assert not torch.equal(res["save", 0]["draw_torch"], res["save", 1]["draw_torch"])  # per-rank RNG kept apart


# --- retention -----------------------------------------------------------------

entries_st = st.lists(st.tuples(st.integers(0, 60), st.booleans()), max_size=25, unique_by=lambda t: t[0])


@settings(max_examples=300, deadline=None)
@given(entries_st, st.integers(1, 6))
def test_retention_properties(raw: list[tuple[int, bool]], keep: int) -> None:
    entries = [SnapshotEntry(s, c) for s, c in raw]
    doomed = set(plan_retention(entries, keep))
    assert doomed <= {e.step for e in entries}
    complete = sorted((e.step for e in entries if e.complete), reverse=True)
    kept_complete = [s for s in complete if s not in doomed]
    assert kept_complete == complete[:keep]  # exactly the newest `keep` complete ones survive
    if complete:
        assert complete[0] not in doomed
        for e in entries:
            if not e.complete:  # partial writes: older ones go, newer ones may be in flight
                assert (e.step in doomed) == (e.step < complete[0])
    else:
        assert not doomed


def test_retention_rejects_bad_input() -> None:
    with pytest.raises(ConfigError) as ei:
        plan_retention([], 0)
    assert ei.value.field == "keep"
    with pytest.raises(ConfigError):
        plan_retention([SnapshotEntry(1, True), SnapshotEntry(1, False)], 1)


def test_writer_applies_retention_and_removes_old_partials(tmp_path: Path) -> None:
    partial = step_dir(tmp_path / "snaps", JOB, 1)
    partial.mkdir(parents=True)
    (partial / "rank0.json").write_text("{}")
    _, w = run_and_snapshot(tmp_path, 8, keep=2)
    w.close()
    left = sorted(p.name for p in (tmp_path / "snaps" / JOB).iterdir())
    assert left == ["step_00000006", "step_00000008"]


# --- partial or corrupt snapshots are never loaded ---------------------------------


def test_partial_and_foreign_snapshots_are_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _, w = run_and_snapshot(tmp_path, 6, keep=3)
    w.close()
    snaps = tmp_path / "snaps"
    s6, s4 = step_dir(snaps, JOB, 6), step_dir(snaps, JOB, 4)
    (s6 / MARKER).unlink()  # newest has no marker: incomplete
    data = next((s4 / "rank0").glob("*.distcp"))
    with open(data, "r+b") as f:  # truncate step 4's data file
        f.truncate(data.stat().st_size - 10)
    with caplog.at_level(logging.INFO, logger="ckptless.snapshot"):
        info = latest_complete(snaps, JOB, 1)
    assert info is not None and info.step == 2
    text = caplog.text
    assert f"{s6} is incomplete" in text
    assert str(s4 / "rank0.json") in text and "files.__0_0.distcp" in text and "truncated" in text
    assert latest_complete(snaps, "other-job", 1) is None
    assert latest_complete(snaps, JOB, 2) is None

    # a (self-consistent) marker copied from another job is refused, naming the field
    s2 = step_dir(snaps, JOB, 2)
    info2 = verify_snapshot(s2, JOB, 1)
    (s2 / MARKER).write_bytes(marker_bytes(dataclasses.replace(info2, job_id="job-b")))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ckptless.snapshot"):
        assert latest_complete(snaps, JOB, 1) is None
    assert "field job_id='job-b'" in caplog.text and str(s2 / MARKER) in caplog.text


def test_corrupt_bytes_fail_checksum_and_leave_state_untouched(tmp_path: Path) -> None:
    _, w = run_and_snapshot(tmp_path, 2)
    w.close()
    sdir = step_dir(tmp_path / "snaps", JOB, 2)
    data = next((sdir / "rank0").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    # flip a byte inside the tensor payload (the file ends with torch.save records)
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    assert latest_complete(tmp_path / "snaps", JOB, 1) is None  # the content check sees it
    info = latest_complete(tmp_path / "snaps", JOB, 1, verify_content=False)
    assert info is not None  # sizes match: a size-only check cannot tell
    fresh = Job(seed=5)
    before = [p.detach().clone() for p in fresh.model.parameters()]
    with pytest.raises(SnapshotIntegrityError) as ei:
        load_snapshot(info, fresh.reg, 0)
    assert isinstance(ei.value, IntegrityError) and isinstance(ei.value, SnapshotError)
    assert ei.value.path == data and ei.value.step == 2 and str(data) in str(ei.value)
    assert all(torch.equal(a, b) for a, b in zip(before, fresh.model.parameters()))

    # a tampered part record is refused by the marker's digest
    (sdir / "rank0.json").write_text((sdir / "rank0.json").read_text().replace('"step":2', '"step":2 '))
    with pytest.raises(SnapshotError, match="digest"):
        load_snapshot(info, fresh.reg, 0)


def test_rank0_gives_up_when_a_rank_never_finishes(tmp_path: Path) -> None:
    job = Job()
    w = SnapshotWriter(cfg(tmp_path, completion_timeout_s=0.3), job.reg, 0, 2)
    job.step(); job.step()
    assert w.maybe_snapshot(2)
    with pytest.raises(SnapshotError, match=r"ranks \[1\] did not finish"):
        w.wait(30)
    assert not (step_dir(tmp_path / "snaps", JOB, 2) / MARKER).exists()
    assert latest_complete(tmp_path / "snaps", JOB, 2) is None


# --- disk full -------------------------------------------------------------------


def test_enospc_becomes_disk_full_and_keeps_older_snapshots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job, w = run_and_snapshot(tmp_path, 2)
    import torch.distributed.checkpoint.filesystem as fs

    def full(*a: Any, **k: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fs, "_write_item", full)
    job.step(); job.step()
    assert w.maybe_snapshot(4)
    with pytest.raises(DiskFullError, match="no space left"):
        w.wait(30)
    monkeypatch.undo()
    assert not (step_dir(tmp_path / "snaps", JOB, 4) / MARKER).exists()
    info = latest_complete(tmp_path / "snaps", JOB, 1)
    assert info is not None and info.step == 2
    load_snapshot(info, Job(seed=3).reg, 0)
    w.close()


# --- busy policy, config ---------------------------------------------------------


def test_busy_writer_skips_without_blocking(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    release = threading.Event()
    real = SnapshotWriter._write_part

    def slow(self: SnapshotWriter, *a: Any) -> None:
        assert release.wait(30)
        real(self, *a)

    monkeypatch.setattr(SnapshotWriter, "_write_part", slow)
    job = Job()
    w = SnapshotWriter(cfg(tmp_path), job.reg, 0, 1)
    assert w.maybe_snapshot(2) and w.busy
    with caplog.at_level(logging.WARNING, logger="ckptless.snapshot"):
        assert not w.maybe_snapshot(4)
    assert "snapshot of step 4 skipped" in caplog.text
    release.set()
    w.close(30)
    info = latest_complete(tmp_path / "snaps", JOB, 1)
    assert info is not None and info.step == 2
    with pytest.raises(SnapshotError, match="closed"):
        w.snapshot(6)


@pytest.mark.parametrize("kw,field", [
    ({"every": 0}, "every"), ({"every": -3}, "every"), ({"keep": 0}, "keep"), ({"on_busy": "block"}, "on_busy"),
    ({"completion_timeout_s": 0}, "completion_timeout_s"), ({"job_id": "../x"}, "job_id"),
])
def test_invalid_config_names_field(tmp_path: Path, kw: dict[str, Any], field: str) -> None:
    args: dict[str, Any] = {"directory": tmp_path, "job_id": JOB, **kw}
    with pytest.raises(ConfigError) as ei:
        SnapshotConfig(**args)
    assert ei.value.field == field and ei.value.value == kw[field]


def test_unwritable_directory_and_disabled(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError) as ei:
        SnapshotConfig(blocker / "sub", JOB, every=2)
    assert ei.value.field == "directory" and str(blocker / "sub") in str(ei.value)
    off = SnapshotConfig(blocker / "sub", JOB, every=0, enabled=False)  # disabled: no checks, no I/O
    w = SnapshotWriter(off, Job().reg, 0, 1)
    assert not w.maybe_snapshot(2) and not w.snapshot(2)
    w.close()
