"""The plain init's resume after a torchrun restart (``worker/plain_resume.py``): every rank reads only its
own files of a candidate snapshot and the ranks vote through a real TCPStore, so they resume from the
same step, or none does.

Real snapshot files (three ``SnapshotWriter``s in one process: completion is file based) and a real
``torch.distributed.TCPStore``; the ranks are threads, each with its own client. The whole-job test
under torchrun is ``tests/e2e/test_chaos_goodput_e2e.py::test_plain_init_under_torchrun_resumes_from_the_last_dcp_checkpoint``.
"""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from ckptless.errors import RecoveryError, SnapshotError
from ckptless.snapshot import SnapshotInfo, scan_steps, verify_rank, verify_snapshot
from ckptless.snapshot import reader
from ckptless.worker.plain_resume import choose_agreed

from ..harness.snapshot_job import JOB, world_snapshots

W = 3


def snapshots(tmp: Path) -> Path:
    """A world-3 run's snapshots at steps 4 and 6 (every 2, the newest two kept)."""
    d = world_snapshots(tmp, W, range(W))
    assert [s for s, _ in scan_steps(d, JOB)] == [6, 4]
    return d


def flip(d: Path, step: int, rank: int) -> Path:
    """Flip one byte of ``rank``'s largest data file of ``step`` (same size: only a checksum sees it)."""
    files = [p for p in (d / JOB / f"step_{step:08d}" / f"rank{rank}").iterdir() if p.name != ".metadata"]
    f = max(files, key=lambda p: p.stat().st_size)
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0x01
    f.write_bytes(bytes(b))
    reader.forget_verified()
    return f


def new_server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, W + 1, True, timedelta(seconds=30), wait_for_workers=False)


def vote(d: Path, ranks: range | list[int] = range(W), deadline_s: float = 30.0, generation: int = 1,
         server: dist.TCPStore | None = None) -> dict[int, Any]:
    """Run ``choose_agreed`` on ``ranks`` at once, each a thread with its own client of ``server``."""
    server = server or new_server()
    out: dict[int, Any] = {}

    def one(rank: int) -> None:
        client = dist.TCPStore("127.0.0.1", server.port, W + 1, False, timedelta(seconds=30))
        try:
            out[rank] = choose_agreed(d, JOB, rank, W, client, generation, deadline_s)
        except Exception as exc:  # noqa: BLE001 - the test asserts on it
            out[rank] = exc

    threads = [threading.Thread(target=one, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(deadline_s + 30)
    assert not any(t.is_alive() for t in threads)
    return out


def steps_of(out: dict[int, Any]) -> dict[int, int | None]:
    return {r: (v.step if isinstance(v, SnapshotInfo) else None) for r, v in out.items()}


def test_every_rank_takes_the_newest_snapshot_when_every_part_verifies(tmp_path: Path) -> None:
    assert steps_of(vote(snapshots(tmp_path))) == {0: 6, 1: 6, 2: 6}


def test_one_ranks_bad_part_passes_the_step_over_on_every_rank(tmp_path: Path) -> None:
    d = snapshots(tmp_path)
    flip(d, 6, 2)
    assert steps_of(vote(d)) == {0: 4, 1: 4, 2: 4}


def test_no_step_good_everywhere_means_a_fresh_start_on_every_rank(tmp_path: Path) -> None:
    d = snapshots(tmp_path)
    flip(d, 6, 1)
    flip(d, 4, 0)
    assert vote(d) == {0: None, 1: None, 2: None}


def test_a_rank_reads_only_its_own_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What makes the restart O(S) per rank: another rank's corrupt file is not read (its own vote says so)."""
    d = snapshots(tmp_path)
    flip(d, 6, 1)
    with pytest.raises(SnapshotError):
        verify_snapshot(d / JOB / "step_00000006", JOB, W, verify_content=True)  # what every rank ran before
    read: list[Path] = []
    real = reader.check_file

    def record(record_path: Path, step: int, path: Path, want: Any) -> None:
        read.append(path)
        real(record_path, step, path, want)

    monkeypatch.setattr(reader, "check_file", record)
    assert verify_rank(d / JOB / "step_00000006", JOB, W, 0).step == 6
    assert read and {p.parent.name for p in read} == {"rank0"}


def test_a_rank_that_never_votes_fails_the_others_at_the_deadline(tmp_path: Path) -> None:
    out = vote(snapshots(tmp_path), ranks=[0, 1], deadline_s=1.0)
    assert all(isinstance(v, RecoveryError) and "vote" in str(v) for v in out.values()), out


def test_a_restart_never_reads_an_earlier_rounds_votes(tmp_path: Path) -> None:
    """One store for both rounds, as torchrun's agent keeps it across restarts: generation 1 passed step 6
    over (rank 2's part was bad); generation 2, with the part mended, takes it (its votes are its own)."""
    d = snapshots(tmp_path)
    server = new_server()
    f = flip(d, 6, 2)
    assert steps_of(vote(d, generation=1, server=server)) == {0: 4, 1: 4, 2: 4}
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0x01
    f.write_bytes(bytes(b))
    reader.forget_verified()
    assert steps_of(vote(d, generation=2, server=server)) == {0: 6, 1: 6, 2: 6}


def test_an_earlier_rounds_keys_under_the_same_generation_are_refused(tmp_path: Path) -> None:
    """torchrun does not raise the restart count for a membership change, and keeps its store: a second
    round under generation 1 meets the first's keys. Every rank refuses (no rank resumes from a step the
    others may not take)."""
    d = snapshots(tmp_path)
    server = new_server()
    assert steps_of(vote(d, generation=1, server=server)) == {0: 6, 1: 6, 2: 6}
    again = vote(d, generation=1, server=server, deadline_s=5.0)
    assert all(isinstance(v, RecoveryError) and "earlier round" in str(v) for v in again.values()), again


def test_any_error_in_a_ranks_own_check_is_a_bad_vote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not only SnapshotError: a rank whose check raises anything votes bad (it never leaves the others
    waiting for a vote), and the step is passed over on every rank."""
    import ckptless.worker.plain_resume as pr

    d = snapshots(tmp_path)
    real = pr.verify_rank

    def flaky(path: Path, job_id: str, world_size: int, rank: int) -> SnapshotInfo:
        if rank == 1 and path.name.endswith("06"):
            raise ValueError("an unexpected failure")
        return real(path, job_id, world_size, rank)

    monkeypatch.setattr(pr, "verify_rank", flaky)
    assert steps_of(vote(d)) == {0: 4, 1: 4, 2: 4}


def test_rank_0_unable_to_list_tells_the_others_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptless.worker.plain_resume as pr

    d = snapshots(tmp_path)

    def unlistable(directory: Path | str, job_id: str) -> list[tuple[int, Path]]:
        raise SnapshotError(f"{directory}: cannot list snapshots (permission denied)")

    monkeypatch.setattr(pr, "scan_steps", unlistable)
    out = vote(d, deadline_s=60.0)
    assert isinstance(out[0], SnapshotError)
    assert all(isinstance(out[r], RecoveryError) and "could not list" in str(out[r]) for r in (1, 2)), out
