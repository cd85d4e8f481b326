"""`ckptless report`: text and JSON output, merged rank ledgers, clean errors (exit 2, one line)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckptless.cli import main
from ckptless.goodput import Event, EventKind, Ledger

from .conftest import REPO, child_env

K = EventKind


def ev(kind: EventKind, t: float, step: int | None = None, rank: int | None = 0, gen: int = 0,
       **attrs: float) -> Event:
    return Event(kind, t, rank, gen, step, attrs)


def rank_ledger(rank: int) -> Ledger:
    """Steps 1-5 (1 s each), fault at 5.5, resume from 3; job-level events on rank 0's file only."""
    es = [ev(K.JOB_START, 0.0, rank=None)] if rank == 0 else []
    es += [ev(K.STEP_DONE, float(s) + rank * 0.01, s, rank=rank) for s in range(1, 6)]
    if rank == 0:
        es += [ev(K.FAILURE_DETECTED, 5.6, rank=None, fault_t=5.5), ev(K.GROUPS_REFORMED, 5.8, rank=None, gen=1)]
    es += [ev(K.TRANSFER_DONE, 6.3 + rank * 0.01, rank=rank, gen=1),
           ev(K.ROLLBACK_DONE, 6.4 + rank * 0.01, 3, rank=rank, gen=1),
           ev(K.FIRST_STEP_AFTER_RECOVERY, 7.4 + rank * 0.01, 4, rank=rank, gen=1),
           ev(K.STEP_DONE, 8.4 + rank * 0.01, 5, rank=rank, gen=1)]
    if rank == 0:
        es.append(ev(K.JOB_END, 9.0, rank=None, gen=1))
    return Ledger(es)


def test_text_report_from_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "rank0.jsonl"
    rank_ledger(0).save(path)
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("goodput 55.6%") and "reformation" in out and "incidents 1" in out


def test_json_report_from_directory_merges_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for r in (0, 1):
        rank_ledger(r).save(tmp_path / f"rank{r}.jsonl")
    (tmp_path / "notes.txt").write_text("ignored")
    assert main(["report", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["wall_s"] == pytest.approx(9.0) and doc["goodput"] == pytest.approx(5 / 9)
    assert doc["steps_done"] == 5 and doc["steps_lost"] == 2
    assert sum(doc["seconds"].values()) == pytest.approx(9.0)
    (inc,) = doc["incidents"]
    assert inc["resume_step"] == 3 and inc["phases"]["reformation"] == pytest.approx(0.2)
    # rank 1's view of the same run, chosen with --ref-rank
    assert main(["report", str(tmp_path), "--json", "--ref-rank", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["steps_done"] == 5


@pytest.mark.parametrize("setup,needle", [
    ("missing", "no such file or directory"),
    ("empty_dir", "no *.jsonl ledger files"),
    ("bad_json", "line 2"),
    ("bad_field", "line 1: kind"),
    ("backwards", "line 2: t_monotonic"),
    ("binary", "not UTF-8"),
])
def test_errors_are_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], setup: str,
                                    needle: str) -> None:
    good = ev(K.JOB_START, 1.0, rank=None).to_json()
    target = tmp_path / "ledger.jsonl"
    if setup == "missing":
        target = tmp_path / "nope.jsonl"
    elif setup == "empty_dir":
        target = tmp_path / "empty"
        target.mkdir()
    elif setup == "bad_json":
        target.write_text(good + "\n{not json\n")
    elif setup == "bad_field":
        target.write_text(json.dumps({"kind": "exploded", "t_monotonic": 1.0, "generation": 0}) + "\n")
    elif setup == "backwards":
        target.write_text(good + "\n" + ev(K.STEP_DONE, 0.5, 1).to_json() + "\n")
    else:
        target.write_bytes(b"\xff\xfe\x00garbage\n")
    assert main(["report", str(target)]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    err = cap.err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("ckptless report: error:"), err
    assert needle in err and str(target) in err and "Traceback" not in err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert main(["report"]) == 2
    assert main(["report", "x.jsonl", "--ref-rank", "-1"]) == 2
    assert "usage" in capsys.readouterr().err


def test_console_invocation_without_traceback(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "ckptless.cli", "report", str(tmp_path / "missing.jsonl")],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().endswith("no such file or directory")
