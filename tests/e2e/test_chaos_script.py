"""``ckptless-chaos run SCENARIO --script PATH``: chaos on a user's own script.

Real etcd, real agents and workers, a real SIGKILL at an exact step (the
library's pause point), and the library's own digests as the verdict: a
correct script PASSes, one that forgets its data position FAILs naming the
objects that differ. Each e2e test is two job runs (fault-free + faulty) of
1 node x 2 workers; the heavier scenarios are ``slow``. Synchronisation is on
files and process exits inside the runner, never on sleeps.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptless.chaos.schedule import Fault, FaultKind
from ckptless.chaos.script import ScriptJob, compare_digests, plan_faults, points_spec
from ckptless.errors import ConfigError
from ckptless.report.loader import load_run
from ckptless.report.model import build_report

from ..harness.chaos_cli import run_chaos as _run
from ..harness.chaos_cli import verdict as _verdict
from ..harness.repo import SCRIPTS

OK = SCRIPTS / "chaos_user_ok.py"
NOPROTECT = SCRIPTS / "chaos_user_noprotect.py"
SMALL = ["--nnodes", "1", "--nproc-per-node", "2"]


# --- end to end ----------------------------------------------------------------------------------
@pytest.mark.timeout(240)
def test_correct_script_passes_kill_worker(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # (a minimum no link reaches: the agent must say its mirrors' link is slow, and still run the job)
    code, text = _run(capsys, "run", "kill-worker", "--script", str(OK), *SMALL, "--out", str(tmp_path),
                      "--env", "CKPTLESS_MIRROR_MIN_GBPS=1000000", "--", "--steps", "24")
    line = _verdict(text)
    assert code == 0, text
    assert line.startswith("PASS kill-worker (SIGKILL rank 1 at step 8)"), line
    assert "bitwise equal" in line
    digests = sorted((tmp_path / "kill-worker" / "digest").glob("digest_rank*.json"))
    assert len(digests) == 2
    doc = json.loads(digests[0].read_text())
    assert {"model", "optimizer", "scheduler", "data", "rng"} <= set(doc["objects"]) and doc["step"] == 24
    # the injection is in the run's goodput dir, so the report starts the incident at the kill
    events = [json.loads(ln) for ln in (tmp_path / "kill-worker" / "goodput" / "chaos.jsonl").read_text().splitlines()]
    assert [(e["kind"], e["attrs"]["kind"], e["attrs"]["target"], e["step"]) for e in events] == [
        ("fault_injected", "kill_worker", 1, 8)]
    # the leader's job-level events: the incident names its lost ranks, the plan how it resumed
    lead = [json.loads(ln) for ln in (tmp_path / "kill-worker" / "goodput" / "leader.jsonl").read_text().splitlines()]
    kinds = [(e["kind"], e["rank"]) for e in lead]
    assert ("incident_opened", None) in kinds and ("plan_published", None) in kinds, kinds
    opened = next(e for e in lead if e["kind"] == "incident_opened")
    # The incident opens on its first symptom: rank 1's exit record, or a survivor's report of the failed
    # collective when that reached etcd first (recovery/leader_machine.py _open: the ranks known lost then,
    # none yet); the plan names the lost rank either way.
    assert opened["attrs"]["lost"] in ("1", "") and opened["generation"] == 0, opened
    published = next(e for e in lead if e["kind"] == "plan_published")
    assert published["attrs"]["decision"] == "memory" and published["generation"] == 1
    assert published["attrs"]["lost"] == "1", published
    rep = build_report(load_run(tmp_path / "kill-worker" / "goodput"))
    assert len(rep.analysis.incidents) == 1
    # the mirrors' network, named and measured at start: in the report, and warned about on stderr
    assert any(n.startswith("mirrors of node ") and "Gb/s to" in n for n in rep.notes), rep.notes
    agent_log = (tmp_path / "kill-worker" / "logs" / "agent0.log").read_text()
    assert "ckptless-run: mirrors on " in agent_log and "below CKPTLESS_MIRROR_MIN_GBPS=1e+06" in agent_log
    inc = rep.analysis.incidents[0]
    assert inc.lost_ranks == (1,) and inc.kill_to_first_step_s is not None and inc.kill_to_first_step_s > 0


@pytest.mark.slow  # CI budget: same run path as the test above; the verdict naming objects is unit-tested below
@pytest.mark.timeout(240)
def test_script_without_data_position_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, text = _run(capsys, "run", "kill-worker", "--script", str(NOPROTECT), *SMALL, "--out", str(tmp_path),
                      "--", "--steps", "24")
    line = _verdict(text)
    assert code == 1, text
    assert line.startswith("FAIL kill-worker"), line
    assert "model" in line and "differ" in line, line  # the objects that differ are named
    assert "no protected object holds a data position" in line  # and the library's warning explains why
    # the job itself recovered: the FAIL is the script's, not a crash
    assert "generation 1" in text and "lost ranks [1]" in text


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("scenario,extra", [
    ("hang-worker", ["--nnodes", "1", "--nproc-per-node", "2", "--hang-timeout", "2"]),
    ("kill-twice", ["--nnodes", "1", "--nproc-per-node", "2"]),
    ("kill-node", ["--nnodes", "2", "--nproc-per-node", "1"]),
])
def test_more_scenarios_pass_on_the_loop_api(scenario: str, extra: list[str], tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    code, text = _run(capsys, "run", scenario, "--script", str(OK), *extra, "--out", str(tmp_path),
                      "--", "--steps", "30", "--loop-api")
    line = _verdict(text)
    assert code == 0, text
    assert line.startswith(f"PASS {scenario}"), line


# --- fast checks ---------------------------------------------------------------------------------
def test_default_fault_steps_and_victims() -> None:
    job = ScriptJob(OK, nnodes=2, nproc_per_node=2, spares=2)
    assert plan_faults("kill-worker", job, 30) == [Fault(10, FaultKind.KILL_WORKER, (3,))]
    assert plan_faults("hang-worker", job, 30, rank=0) == [Fault(10, FaultKind.HANG_WORKER, (0,))]
    assert plan_faults("kill-twice", job, 30) == [Fault(10, FaultKind.KILL_WORKER, (3,)),
                                                  Fault(20, FaultKind.KILL_WORKER, (3,))]
    assert plan_faults("kill-node", job, 30) == [Fault(15, FaultKind.KILL_AGENT, (3,))]
    assert plan_faults("kill-worker", job, 30, at=[3]) == [Fault(3, FaultKind.KILL_WORKER, (3,))]
    assert points_spec(plan_faults("kill-twice", job, 30)) == "f0r3=step:r3:10,f1r3=step:r3:20"


@pytest.mark.parametrize("name,kw,field", [
    ("kill-node", {"spares": 1}, "spares"),        # a dead node's 2 ranks need 2 spares
    ("kill-worker", {"at": [30]}, "at"),           # past the last step
    ("kill-twice", {"at": [5]}, "at"),             # needs two steps
    ("kill-worker", {"rank": 4}, "rank"),
    ("node-loss", {}, "scenario"),                 # a matrix name, not a --script scenario
])
def test_bad_plans_are_refused(name: str, kw: dict[str, object], field: str) -> None:
    spares = kw.pop("spares", 0)
    job = ScriptJob(OK, nnodes=2, nproc_per_node=2, spares=spares)  # type: ignore[arg-type]
    with pytest.raises(ConfigError) as err:
        plan_faults(name, job, 30, **kw)  # type: ignore[arg-type]
    assert err.value.field == field


def test_digest_comparison_names_objects_and_groups_ranks() -> None:
    def d(step: int, **objs: str) -> dict[str, object]:
        return {"step": step, "objects": objs}

    want = {r: d(24, model="a", optimizer="b", data="c", rng="d") for r in range(4)}
    got = {0: d(24, model="x", optimizer="y", data="c", rng="d"), 1: d(24, model="x", optimizer="y", data="c", rng="d"),
           2: d(24, model="a", optimizer="b", data="c", rng="d"), 3: d(23, model="a", optimizer="b", data="c", rng="z")}
    assert compare_digests(want, want, 4) == []
    assert compare_digests(got, want, 4) == ["rank 3: final step 23 != 24 of the fault-free run",
                                             "ranks 0-1: model, optimizer differ", "rank 3: rng differ"]
    assert compare_digests({}, want, 2)[0].startswith("rank 0 wrote no digest")


def test_bad_input_is_exit_2_without_running(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, text = _run(capsys, "run", "kill-worker", "--script", str(tmp_path / "missing.py"), "--out", str(tmp_path))
    assert code == 2 and "no such file" in text
    code, text = _run(capsys, "run", "kill-node", "--script", str(OK), "--spares", "1", "--out", str(tmp_path))
    assert code == 2 and "spares" in text
    code, text = _run(capsys, "run", "kill-worker", "--script", str(OK), "--nnodes", "1", "--nproc-per-node", "1")
    assert code == 2 and ">= 2 ranks" in text
    code, text = _run(capsys, "list", "--", "x")
    assert code == 2 and "--script" in text
    assert not any(tmp_path.glob("*/logs"))  # nothing was started


def test_demo_plan_fits_its_spares() -> None:
    """The node loss comes first: it needs both warm spares (a dead node cannot respawn its ranks)."""
    from ckptless.chaos.catalogue import demo_faults, demo_job

    job = demo_job(1000)
    faults = demo_faults(1000)
    assert [f.kind for f in faults] == [FaultKind.KILL_AGENT, FaultKind.KILL_WORKER, FaultKind.HANG_WORKER]
    assert [f.step for f in faults] == sorted({f.step for f in faults}) and 0 < faults[0].step
    assert job.spares >= job.nproc_per_node and job.hang_timeout
    assert faults[0].targets[0] // job.nproc_per_node == 1  # node 1 is lost; the later victims live on node 0
    assert all(f.targets[0] // job.nproc_per_node == 0 for f in faults[1:])
    with pytest.raises(ConfigError):
        demo_job(10)


def test_digest_of_a_zero_dim_tensor() -> None:
    """Adam/AdamW's state['step'] is 0-dim: the digest must hash it (it used to raise at close())."""
    import torch

    from ckptless.state.digest import object_digest

    assert object_digest({"step": torch.tensor(3.0)}) != object_digest({"step": torch.tensor(4.0)})


def test_agent_that_exits_at_start_is_named_at_once(tmp_path: Path) -> None:
    """An agent that ends before a leader exists (here a config error: --spare-refill without spares)
    is reported at once with its log, not after a 120 s wait for a leader."""
    import time

    from ckptless.chaos.cluster import AgentExited, ClusterSpec, LocalCluster

    t0 = time.monotonic()
    with pytest.raises(AgentExited, match="spare_refill"):
        with LocalCluster(ClusterSpec(agent_args=("--spare-refill",)), tmp_path, "bad-flags") as cluster:
            cluster.start()
    assert time.monotonic() - t0 < 60
