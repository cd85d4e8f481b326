"""`ckptless report`: terminal and JSON output of the merged ranks, HTML, baseline and estimate inputs,
run-dir lookup, headers never cut, clean errors (exit 2, one line)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckptless.cli import main
from ckptless.goodput import Event, EventKind, Ledger

from ..harness.repo import REPO, child_env

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


HEADERS = ("category", "seconds", "share", "ml-goodput-measurement", "re-formation", "disk restore", "first step",
           "sum = downtime", "kill -> first step s", "re-protection s (bg)", "restart-from-disk (ESTIMATE)")


def test_text_report_from_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "rank0.jsonl"
    rank_ledger(0).save(path)
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "goodput 55.6%" in out and "incidents 1" in out and "Recovery phases" in out
    assert all(h in out for h in HEADERS), [h for h in HEADERS if h not in out]
    assert "…" not in out and "monotonic" in out  # nothing cut; old ledger: says which clock


def test_headers_are_never_cut_on_a_narrow_terminal(tmp_path: Path) -> None:
    for r in (0, 1):
        rank_ledger(r).save(tmp_path / f"rank{r}.jsonl")
    env = dict(child_env(), COLUMNS="40")
    proc = subprocess.run([sys.executable, "-m", "ckptless.cli", "report", str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert all(h in proc.stdout for h in HEADERS) and "…" not in proc.stdout


def test_json_report_from_directory_merges_ranks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for r in (0, 1):
        rank_ledger(r).save(tmp_path / f"rank{r}.jsonl")
    (tmp_path / "notes.txt").write_text("ignored")
    assert main(["report", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    # merged: each step ends with the slower rank (+0.01 s); phases end at the last rank
    assert doc["wall_s"] == pytest.approx(9.0) and doc["goodput"] == pytest.approx(5 / 9)
    assert doc["steps_done"] == 5 and doc["steps_lost"] == 2 and doc["clock"] == "monotonic"
    assert sum(doc["seconds"].values()) == pytest.approx(9.0)
    assert doc["seconds"]["wasted_progress"] == pytest.approx(2.49)  # steps 4, 5 and 5.01 -> 5.5
    assert doc["seconds"]["startup"] == pytest.approx(0.01)
    (inc,) = doc["incidents"]
    assert inc["resume_step"] == 3 and inc["started_at"] == pytest.approx(5.5)  # the detector's fault_t
    assert inc["phases"] == pytest.approx({"detection": 0.1, "reformation": 0.2, "transfer": 0.51,
                                           "rollback": 0.1, "first_step": 1.0})
    assert inc["downtime_s"] == pytest.approx(1.91) and inc["kill_to_first_step_s"] == pytest.approx(1.91)
    est = doc["restart_from_disk"]["estimate"]
    assert est["label"] == "estimate" and est["inputs"]["checkpoint_interval_steps"] == 500
    # rank 1's own view of the same run, chosen with --ref-rank
    assert main(["report", str(tmp_path), "--json", "--ref-rank", "1"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["view"] == "one rank" and one["steps_done"] == 5


def test_estimate_inputs_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for r in (0, 1):
        rank_ledger(r).save(tmp_path / f"rank{r}.jsonl")
    assert main(["report", str(tmp_path), "--json", "--ckpt-every", "2", "--restart-s", "1", "--load-s", "0.5",
                 "--save-s", "0.1"]) == 0
    est = json.loads(capsys.readouterr().out)["restart_from_disk"]["estimate"]
    assert est["inputs"]["interval_source"] == "--ckpt-every"
    (f,) = est["failures"]
    # fault after step 5 (resume 3 + 2 lost): 1 step since the checkpoint at 4, which must be loaded
    assert (f["fault_step"], f["lost_steps"]) == (5, 1)
    assert f["seconds"] == pytest.approx(1 + 0.5 + 0.01 + 1 * 1.0)
    assert est["checkpoint_saves"] == 2 and est["checkpoint_save_s"] == pytest.approx(0.2)


def test_run_dir_html_and_baseline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    (run / "goodput").mkdir(parents=True)
    for r in (0, 1):
        rank_ledger(r).save(run / "goodput" / f"rank{r}.jsonl")
    (run / "pids_rank0.jsonl").write_text('{"pid": 1}\n')  # a run dir holds other JSON Lines files
    base = tmp_path / "base"
    base.mkdir()
    Ledger([ev(K.JOB_START, 0.0, rank=None)] + [ev(K.STEP_DONE, float(s), s) for s in range(1, 6)]
           + [ev(K.JOB_END, 5.5, rank=None)]).save(base / "rank0.jsonl")
    page = tmp_path / "out" / "report.html"
    assert main(["report", str(run), "--html", str(page), "--baseline", str(base)]) == 0
    out = capsys.readouterr().out
    assert "Measured baseline" in out and f"wrote {page}" in out
    text = page.read_text(encoding="utf-8")
    assert '<svg id="timeline"' in text and "Measured baseline" in text and "ESTIMATE" in text
    assert main(["report", str(run), "--json", "--baseline", str(base)]) == 0
    b = json.loads(capsys.readouterr().out)["restart_from_disk"]["baseline"]
    assert b["has_failures"] is False and b["wall_delta_s"] == pytest.approx(5.5 - 9.0)


def test_a_last_line_cut_short_is_skipped_with_a_note(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A SIGKILLed rank (or a live one) may leave its last line without a newline: report the rest."""
    for r in (0, 1):
        rank_ledger(r).save(tmp_path / f"rank{r}.jsonl")
    with open(tmp_path / "rank1.jsonl", "a", encoding="utf-8") as f:
        f.write('{"kind": "step_done", "t_monot')
    assert main(["report", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["steps_done"] == 5 and any("rank1.jsonl: ignored an unfinished last line" in n for n in doc["notes"])
    (tmp_path / "rank1.jsonl").write_text('{"kind": "step_done", "t_monot\n')  # with its newline: an error
    assert main(["report", str(tmp_path)]) == 2
    assert "line 1" in capsys.readouterr().err


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
    assert main(["report", "x.jsonl", "--ckpt-every", "0"]) == 2
    assert main(["report", "x.jsonl", "--restart-s", "-1"]) == 2
    assert main(["status", "--rdzv-id", "j"]) == 2
    assert "usage" in capsys.readouterr().err


def test_console_invocation_without_traceback(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "ckptless.cli", "report", str(tmp_path / "missing.jsonl")],
                          cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().endswith("no such file or directory")


def test_a_baseline_with_failures_replaces_the_estimate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 39: a measured baseline that had failures (torchrun + DCP with the same faults) is what the page
    compares with; the restart-from-disk ESTIMATE stays only where no such baseline ran."""
    run, base = tmp_path / "run", tmp_path / "base"
    for d in (run, base):
        d.mkdir()
        for r in (0, 1):
            rank_ledger(r).save(d / f"rank{r}.jsonl")
    page = tmp_path / "report.html"
    assert main(["report", str(run), "--html", str(page), "--baseline", str(base)]) == 0
    out = capsys.readouterr().out
    assert "Measured baseline" in out and "ESTIMATE" not in out and "steps done / lost" in out
    text = page.read_text(encoding="utf-8")
    assert "Measured baseline" in text and "baseline goodput (measured)" in text
    assert "ESTIMATE" not in text and "restart-from-disk goodput (estimate)" not in text
    assert main(["report", str(run), "--html", str(page)]) == 0  # no baseline: the estimate, labelled
    capsys.readouterr()
    assert "ESTIMATE" in page.read_text(encoding="utf-8")
