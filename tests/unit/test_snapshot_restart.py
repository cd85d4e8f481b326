"""Issue 17: a restart with another world size must neither train beside the old snapshots nor delete them.

Pure rules (``world_mismatch``, ``plan_retention(world_size=...)``) are property-tested; the I/O around
them (markers, the writer's guard and retention, ``set_aside``, the launcher's ``resume_from_disk``)
runs on real snapshot files written by ``SnapshotWriter``. The whole-job e2e test is
``tests/e2e/test_restart_e2e.py::test_restart_with_another_world_size_is_refused_and_loses_nothing``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptless.errors import ConfigError, SnapshotError
from ckptless.launcher.args import LaunchConfig, parse_args
from ckptless.launcher.joining import resume_from_disk
from ckptless.snapshot import (
    MARKER, SnapshotEntry, SnapshotWriter, StoredSnapshot, check_world, latest_complete, plan_retention,
    read_marker, set_aside, step_dir, stored_snapshots, verify_snapshot,
)
from ckptless.snapshot.restart import foreign_owner, marker_world, set_aside_name, world_mismatch

from ..harness.snapshot_job import JOB, Job, cfg, run_and_snapshot, world_snapshots

# --- helpers ---------------------------------------------------------------------


def world2_snapshots(tmp: Path, steps: int = 6, keep: int = 2) -> Path:
    """A world-2 run's snapshots (two writers in one process: completion is file based, no collective)."""
    return world_snapshots(tmp, 2, (1, 2), steps, keep)


def tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` by relative path -> SHA-256 of its bytes."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def steps_in(job_dir: Path) -> list[str]:
    return sorted(p.name for p in job_dir.iterdir())


# --- the pure rules --------------------------------------------------------------


def test_world_mismatch_is_decided_by_the_newest_readable_complete_snapshot() -> None:
    S = StoredSnapshot
    assert world_mismatch([], 2) is None
    assert world_mismatch([S(8, 2), S(4, 2)], 2) is None
    assert world_mismatch([S(16, 4), S(12, 4), S(4, 2)], 2) == (4, (16, 12))
    assert world_mismatch([S(20, None), S(16, 4)], 2) == (4, (16,))  # an unreadable marker decides nothing
    assert world_mismatch([S(20, None)], 2) is None
    assert world_mismatch([S(12, 4), S(16, 2)], 2) is None  # order of the input does not matter: 16 is newest
    assert world_mismatch([S(24, 2), S(16, 4), S(12, 4)], 2) is None  # older foreign ones do not block a match


worlds_st = st.lists(st.tuples(st.integers(0, 60), st.booleans(), st.sampled_from([None, 1, 2, 4])),
                     max_size=25, unique_by=lambda t: t[0])


@settings(max_examples=300, deadline=None)
@given(worlds_st, st.integers(1, 5), st.sampled_from([1, 2, 4]))
def test_retention_never_deletes_another_worlds_complete_snapshot(raw: list[tuple[int, bool, int | None]],
                                                                   keep: int, world: int) -> None:
    entries = [SnapshotEntry(s, c, w if c else None) for s, c, w in raw]
    doomed = set(plan_retention(entries, keep, world))
    own = sorted((e.step for e in entries if e.complete and e.world_size == world), reverse=True)
    for e in entries:
        if e.complete and e.world_size != world:
            assert e.step not in doomed  # another run's (or unreadable): never ours to delete
    assert [s for s in own if s not in doomed] == own[:keep]
    if own:
        for e in entries:
            if not e.complete:
                assert (e.step in doomed) == (e.step < own[0])
    else:
        assert not doomed
    # without a world every complete snapshot counts as the writer's own (the rule before issue 17)
    assert plan_retention(entries, keep) == plan_retention([SnapshotEntry(e.step, e.complete) for e in entries],
                                                           keep, None)


def test_set_aside_name_is_stable_and_refuses_a_bad_job_id() -> None:
    assert set_aside_name("job-a", 0.0) == "job-a.set-aside-19700101T000000Z"
    assert set_aside_name("job-a", 0.0, 2) == "job-a.set-aside-19700101T000000Z-2"
    with pytest.raises(ConfigError):
        set_aside_name("../x", 0.0)


# --- markers, the writer's guard and its retention, on real files --------------------


def test_markers_say_which_world_wrote_them(tmp_path: Path) -> None:
    snaps = world2_snapshots(tmp_path)
    assert [(s.step, s.world_size) for s in stored_snapshots(snaps, JOB)] == [(6, 2), (4, 2)]
    s6 = step_dir(snaps, JOB, 6)
    assert read_marker(s6, JOB).world_size == 2 and marker_world(s6, JOB) == 2
    assert foreign_owner(s6, JOB, 2) is None
    assert foreign_owner(s6, JOB, 1) == "a complete snapshot of world size 2"
    assert foreign_owner(step_dir(snaps, JOB, 8), JOB, 1) is None  # no marker: nobody's
    mm = check_world(snaps, JOB, 1)
    assert mm is not None and (mm.job_dir, mm.world_size, mm.steps, mm.job_world) == (snaps / JOB, 2, (6, 4), 1)
    assert check_world(snaps, JOB, 2) is None and check_world(tmp_path / "nowhere", JOB, 1) is None

    doc = json.loads((s6 / MARKER).read_text())
    doc["world_size"] = 3  # the self-digest no longer matches: corrupt, not "a world of 3"
    (s6 / MARKER).write_text(json.dumps(doc))
    with pytest.raises(SnapshotError, match="marker_sha256"):
        read_marker(s6, JOB)
    assert marker_world(s6, JOB) is None
    assert "cannot read" in (foreign_owner(s6, JOB, 2) or "")
    assert [(s.step, s.world_size) for s in stored_snapshots(snaps, JOB)] == [(6, None), (4, 2)]
    assert check_world(snaps, JOB, 1) is not None and check_world(snaps, JOB, 2) is None


def test_a_writer_of_another_world_neither_overwrites_nor_deletes_complete_snapshots(tmp_path: Path) -> None:
    """The issue's sequence at the writer: a world-1 run trains in a directory of world-2 snapshots."""
    snaps = world2_snapshots(tmp_path, steps=6, keep=2)  # steps 4 and 6 of world 2 remain
    before = {s: tree(step_dir(snaps, JOB, s)) for s in (4, 6)}
    job = Job()
    w = SnapshotWriter(cfg(tmp_path, keep=2), job.reg, 0, 1)  # world 1, snapshots due at 2, 4, ..., 12
    for s in range(1, 13):
        job.step()
        if w.maybe_snapshot(s):
            if s in (4, 6):
                with pytest.raises(SnapshotError, match="world size 2, written by another run: left untouched"):
                    w.wait(30)
            else:
                w.wait(30)
    w.close()
    for s in (4, 6):  # untouched: same files, same bytes, and still verify as world 2
        assert tree(step_dir(snaps, JOB, s)) == before[s]
        assert verify_snapshot(step_dir(snaps, JOB, s), JOB, 2, verify_content=True).step == s
    # the world-1 run's own retention kept its newest two; 4 and 6 were skipped, not written
    assert steps_in(snaps / JOB) == ["step_00000004", "step_00000006", "step_00000010", "step_00000012"]
    info = latest_complete(snaps, JOB, 1)
    assert info is not None and info.step == 12


# --- set_aside --------------------------------------------------------------------


def test_set_aside_moves_everything_unchanged_and_is_a_no_op_on_a_fresh_directory(tmp_path: Path) -> None:
    root = tmp_path / "snaps"
    assert set_aside(root, JOB) is None  # no directory at all
    (root / JOB).mkdir(parents=True)
    assert set_aside(root, JOB) is None and steps_in(root) == [JOB]  # empty: nothing created, nothing moved

    snaps = world2_snapshots(tmp_path)
    before = tree(snaps / JOB)
    moved = set_aside(snaps, JOB, when=0.0)
    assert moved == snaps / "job-a.set-aside-19700101T000000Z"
    assert not (snaps / JOB).exists() and tree(moved) == before
    assert check_world(snaps, JOB, 1) is None  # nothing of the job left to refuse

    run_and_snapshot(tmp_path, 2)[1].close()  # a new run; then a second fresh start in the same second
    again = set_aside(snaps, JOB, when=0.0)
    assert again == snaps / "job-a.set-aside-19700101T000000Z-1" and tree(moved) == before
    assert sorted(p.name for p in snaps.iterdir()) == [moved.name, again.name]


# --- the launcher's start: refuse, or set aside with --fresh-start ----------------------


def launch(snaps: Path, *extra: str) -> LaunchConfig:
    return parse_args(["--nproc-per-node", "2", "--rdzv-id", JOB, "--snapshot-dir", str(snaps), *extra, "x.py"],
                      environ={})


def test_start_with_another_world_is_refused_in_one_line_and_loses_nothing(tmp_path: Path) -> None:
    snaps = world2_snapshots(tmp_path)
    before = tree(snaps)
    cfg_ = launch(snaps)
    for node_rank in (0, 1):  # every node refuses: none waits for a membership that never comes
        with pytest.raises(ConfigError) as ei:
            resume_from_disk(cfg_, 4, (), node_rank)
        err = ei.value
        assert err.field == "world_size" and err.value == 4
        text = str(err)
        assert "\n" not in text and str(snaps / JOB) in text and "world of 2 ranks" in text
        assert "steps 6, 4" in text and "relaunch with 2 ranks" in text and "--fresh-start" in text
    assert tree(snaps) == before

    fb = resume_from_disk(cfg_, 2, (), 0)
    assert fb is not None and fb.snapshot_step == 6
    assert resume_from_disk(cfg_, 2, (), 1) is None


def test_fresh_start_sets_the_snapshots_aside_on_node_0_only(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    snaps = world2_snapshots(tmp_path)
    before = tree(snaps / JOB)
    cfg_ = launch(snaps, "--fresh-start")
    assert cfg_.fresh_start
    assert resume_from_disk(cfg_, 4, (), 1) is None
    assert tree(snaps / JOB) == before  # node 1 never moves anything
    assert resume_from_disk(cfg_, 4, (), 0) is None
    aside = [p for p in snaps.iterdir() if p.name.startswith(f"{JOB}.set-aside-")]
    assert len(aside) == 1 and tree(aside[0]) == before and not (snaps / JOB).exists()
    assert f"set aside, unchanged, in {aside[0]}" in capsys.readouterr().err
    assert resume_from_disk(cfg_, 4, (), 0) is None  # now a fresh dir: a no-op
    assert len([p for p in snaps.iterdir()]) == 1


def test_fresh_start_needs_a_snapshot_dir() -> None:
    with pytest.raises(ConfigError) as ei:
        parse_args(["--nproc-per-node", "2", "--fresh-start", "x.py"], environ={})
    assert ei.value.field == "fresh_start" and "--snapshot-dir" in str(ei.value)
    assert parse_args(["--nproc-per-node", "2", "--snapshot-dir", "/tmp/x", "x.py"], environ={}).fresh_start is False
    on = parse_args(["--nproc-per-node", "2", "--snapshot-dir", "/tmp/x", "x.py"], environ={"PET_FRESH_START": "1"})
    assert on.fresh_start is True
