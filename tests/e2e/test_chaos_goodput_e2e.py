"""``ckptless-chaos goodput`` end to end, and the plain init's DCP resume under torchrun.

Real etcd, real ``ckptless-run`` agents, a real ``python -m torch.distributed.run``, real SIGKILLs.
The goodput run is time-bounded by the tool itself (``--duration-s`` per system); its one kill is
due at 1 s and lands once the victim rank trains (it waits for the rank's announcement file), so
each system gets exactly one failure however slow the start. The torchrun test synchronises on the
ledger files the job writes, never on sleeps.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckptless.chaos.cluster import job_processes_of, wait_gone

from ..harness.chaos_cli import run_chaos
from ..harness.repo import REPO, child_env

DEMO = REPO / "examples" / "train_demo.py"


def _lines(path: Path) -> list[dict[str, object]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


@pytest.mark.rotating(3)  # CI budget: tests/harness/rotation.py (the tool's pieces run daily in tests/unit/test_chaos_goodput.py)
@pytest.mark.timeout(240)
def test_goodput_measures_both_systems_with_the_same_kill(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sched = tmp_path / "schedule.json"
    sched.write_text(json.dumps([{"t": 1.0, "rank": 1, "kind": "kill_worker"}]))
    out, doc_path = tmp_path / "run", tmp_path / "goodput.json"
    code, text = run_chaos(capsys, "goodput", "--script", str(DEMO), "--nnodes", "1", "--nproc-per-node", "2",
                           "--schedule", str(sched), "--duration-s", "25", "--ckpt-every", "10",
                           "--env", "DEMO_STEPS=1000000", "--json", str(doc_path), "--out", str(out), "--", "{out}")
    assert code == 0, text[-6000:]
    doc = json.loads(doc_path.read_text())
    assert doc["schedule"] == [{"t": 1.0, "rank": 1, "kind": "kill_worker"}] and doc["world_size"] == 2
    for system in ("ckptless", "torchrun"):
        f = doc[system]
        assert f["faults_injected"] == 1 and f["incidents"] == 1, (system, f, text[-4000:])
        assert f["ended"] == "stopped", (system, f["ended"])
        assert 0.0 < f["goodput"] < 1.0 and f["steps_kept"] > 0 and f["step_s"] > 0
        assert f["productive_s"] + sum(f["badput_s"].values()) == pytest.approx(f["wall_s"], rel=1e-6, abs=1e-6)
        assert f["wall_s"] == pytest.approx(25.0, abs=3.0)  # stopped at D (plus the stop itself)
        assert len(f["downtime_s"]) == 1
    assert doc["torchrun"]["extra"]["ckpt_every"] == 10 and doc["torchrun"]["extra"]["max_restarts"] == 2
    assert doc["ratio"] == pytest.approx(doc["ckptless"]["goodput"] / doc["torchrun"]["goodput"])
    # the torchrun side restarted every rank (generation 1) from its DCP checkpoint or from step 0
    tr = [e for r in (0, 1) for e in _lines(out / "torchrun" / "goodput" / f"rank{r}.jsonl")]
    assert {e["generation"] for e in tr} == {0, 1}
    assert any(e["kind"] == "first_step_after_recovery" and e["generation"] == 1 for e in tr)
    # ckptless recovered in place: one generation change, no process restart of the survivor
    ck = _lines(out / "ckptless" / "goodput" / "leader.jsonl")
    assert any(e["kind"] == "plan_published" and e["attrs"]["decision"] == "memory" for e in ck)  # type: ignore[index]
    assert "torchrun" in text and "goodput" in text


@pytest.mark.rotating(0)  # CI budget: tests/harness/rotation.py (the plain init's DCP resume; unit-tested daily)
@pytest.mark.timeout(240)
def test_plain_init_under_torchrun_resumes_from_the_last_dcp_checkpoint(tmp_path: Path) -> None:
    """The ported script, unchanged, under plain torchrun: checkpoints every 50 steps, rank 1 killed
    after step 150 once a checkpoint is complete; torchrun restarts every rank and each resumes from the
    newest complete checkpoint."""
    out = tmp_path / "job"
    out.mkdir()
    steps = 600
    env = {**child_env(), "DEMO_STEPS": str(steps), "CKPTLESS_SNAPSHOT_DIR": str(tmp_path / "ckpt"),
           "CKPTLESS_SNAPSHOT_EVERY": "50", "CKPTLESS_GOODPUT_DIR": str(out / "goodput"),
           "CKPTLESS_CHAOS_DIR": str(out / "chaos"), "CHAOS_RUN": str(out)}
    log = open(tmp_path / "torchrun.log", "wb")
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "--max-restarts", "1", str(DEMO), str(out)], env=env, stdout=log, stderr=subprocess.STDOUT,
                         start_new_session=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 150
        done: list[dict[str, object]] = []
        before: list[int] = []  # the checkpoints complete at the kill (retention keeps only the newest two)
        while not (before and any(isinstance(e["step"], int) and e["step"] >= 150 for e in done)):
            assert time.monotonic() < deadline and p.poll() is None, (tmp_path / "torchrun.log").read_text()[-3000:]
            time.sleep(0.02)
            done = [e for e in _lines(out / "goodput" / "rank1.jsonl") if e["kind"] == "step_done"]
            before = [int(m.parent.name.split("_")[-1]) for m in (tmp_path / "ckpt").rglob("COMPLETE.json")]
        pid = json.loads((out / "chaos" / "rank1.json").read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
        assert p.wait(timeout=150) == 0, (tmp_path / "torchrun.log").read_text()[-3000:]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        log.close()
        wait_gone(job_processes_of(out), 15.0)
    gen0 = [e for r in (0, 1) for e in _lines(out / "goodput" / f"rank{r}.jsonl")
            if e["generation"] == 0 and e["kind"] == "step_done"]
    kill_step = max(int(e["step"]) for e in gen0)  # type: ignore[call-overload]  # the newest step before the kill
    for r in (0, 1):
        evs = _lines(out / "goodput" / f"rank{r}.jsonl")
        restores = [e for e in evs if e["kind"] == "disk_restore"]
        assert len(restores) == 1 and restores[0]["generation"] == 1, evs[-5:]
        got = int(restores[0]["step"])  # type: ignore[call-overload]
        # the newest checkpoint complete at the kill: a multiple of 50 at or before the newest step done
        assert got % 50 == 0 and 50 <= got <= kill_step, (got, kill_step)
        assert before and got >= max(before), (got, before)  # none older than the newest complete at the kill
        after = [e for e in evs if e["generation"] == 1 and e["kind"] in ("step_done", "first_step_after_recovery")]
        assert after[0]["kind"] == "first_step_after_recovery" and after[0]["step"] == got + 1
        assert after[-1]["step"] == steps
    assert job_processes_of(out) == []


@pytest.mark.timeout(60)
def test_faults_due_together_are_killed_together(tmp_path: Path) -> None:
    """A node loss in a schedule (two ranks at one time) is one event: both processes are found, then
    both killed at once; a later fault whose rank nobody trains any more waits, and gives up at the end."""
    from ckptless.chaos.goodput import inject
    from ckptless.chaos.goodput_plan import TimedFault

    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        chaos, goodput = tmp_path / "chaos", tmp_path / "goodput"
        chaos.mkdir()
        for r, p in enumerate(procs):
            (chaos / f"rank{r}.json").write_text(json.dumps({"pid": p.pid, "rank": r}))
        t0 = time.monotonic()
        sent = inject([TimedFault(0.1, 0), TimedFault(0.1, 1), TimedFault(0.2, 0)], t0, t0 + 1.5, chaos, goodput,
                      lambda: True, lambda _line: None)
        assert sent == 2
        assert [p.wait(timeout=10) for p in procs] == [-signal.SIGKILL, -signal.SIGKILL]
        evs = _lines(goodput / "chaos.jsonl")
        assert [(e["kind"], e["attrs"]["target"]) for e in evs] == [("fault_injected", 0), ("fault_injected", 1)]  # type: ignore[index]
        assert evs[0]["t_monotonic"] == evs[1]["t_monotonic"]
        assert time.monotonic() - t0 >= 1.5  # the third waited for a process of rank 0 until the end
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
