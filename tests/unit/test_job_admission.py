"""Who may take part in a job (``launcher/admission.py``, ``coordinator/rendezvous.py``; issue 35).

The table of settings every agent must agree on covers every ``LaunchConfig`` field and is the one
docs/launcher.md shows; agents that differ on any must-agree setting are refused with one line
naming it and both values, agents that differ only per node are not; the ended-job decision never
starts a run it may not and never sends an agent of a live relaunch away.
"""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptless.coordinator.rendezvous import (NodeInfo, RoundState, check_agreement, config_disagreement,
                                             decide_close, decide_join)
from ckptless.environment import DEFAULT_SEED, VARIABLES
from ckptless.errors import (ConfigError, ConfigMismatch, JobAlreadyEnded, OtherRunSettings, RendezvousLate,
                             RendezvousTimeout)
from ckptless.launcher.admission import (ENV_SETTINGS, SETTINGS, Records, Relaunch, can_restart, decide_admission,
                                         ended_message, job_config, restart_window)
from ckptless.launcher.args import LaunchConfig, parse_args
from ckptless.recovery.view import JobStatus

DOCS = Path(__file__).resolve().parents[2] / "docs" / "launcher.md"
BASE = ("--nnodes", "2:3", "--rdzv-id", "j", "--rdzv-endpoint", "127.0.0.1:2379", "--snapshot-dir", "/snaps")

# One change per must-agree setting (on top of BASE), and the setting it must be named as.
AGREE_CASES = {
    "--nnodes": ("--nnodes", "2:4"),
    "--replicas": ("--replicas", "2"),
    "--mirror-every": ("--mirror-every", "3"),
    "--placement": ("--placement", "group"),
    "--on-replica-mismatch": ("--on-replica-mismatch", "replace"),
    "--mirror-replicated": ("--mirror-replicated",),
    "--snapshot-every": ("--snapshot-every", "5"),
    "--snapshot-dir": ("--snapshot-dir", "/elsewhere"),
    "--fresh-start": ("--fresh-start",),
    "--node-grace": ("--node-grace", "30"),
    "--replacement-timeout": ("--replacement-timeout", "30"),
    "--lost-node": ("--lost-node", "shrink"),
    "script": ("-m", "train"),
}
PER_NODE = (("--nproc-per-node", "0", "--spares", "3"), ("--nproc-per-node", "4"), ("--lease-ttl", "5"),
            ("--log-dir", "/logs", "--redirects", "3"), ("--metrics-port", "0"), ("--hang-timeout", "30"),
            ("--goodput-dir", "/g"), ("--no-shm-dir",), ("--no-warm-respawn",), ("--local-addr", "10.0.0.2"),
            ("--spares", "1", "--spare-refill"), ("--rdzv-endpoint", "10.0.0.9:2379"), ("--role", "other"),
            ("--rdzv-conf", "join_timeout=60"), ("--max-restarts", "3"), ("--shutdown-timeout", "5"))


ENV: dict[str, str] = {}
ENV_AGREE_CASES = {
    "CKPTLESS_SEED": {"CKPTLESS_SEED": "7"},
    "CKPTLESS_COLLECTIVE_TIMEOUT": {"CKPTLESS_COLLECTIVE_TIMEOUT": "30"},
    "CKPTLESS_CPU_BACKEND": {"CKPTLESS_CPU_BACKEND": "nccl_like"},
    "CKPTLESS_CUDA_BACKEND": {"CKPTLESS_CUDA_BACKEND": "gloo"},
    "CKPTLESS_MIRROR_BUFFERS": {"CKPTLESS_MIRROR_BUFFERS": "1"},
}
ENV_PER_NODE = ({"CKPTLESS_RECOVERY_TIMEOUT": "30"}, {"CKPTLESS_CAPTURE_ORDER": "step"}, {"CKPTLESS_LOG_LEVEL": "INFO"},
                {"CKPTLESS_NODE_GPUS": "0"}, {"CKPTLESS_LOCAL_ADDR": "10.0.0.2"}, {"CKPTLESS_PRELOAD": "numpy"},
                {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}, {"CKPTLESS_ETCD_USER": "u"})


def cfg(*flags: str, script: str = "train.py", args: tuple[str, ...] = ("--lr", "0.1")) -> LaunchConfig:
    return parse_args([*BASE, *flags, script, *args], environ={})


def conf(*flags: str, env: dict[str, str] | None = None, **kw: Any) -> dict[str, Any]:
    return job_config(cfg(*flags, **kw), ENV if env is None else env)


def test_every_launch_config_field_is_decided_once() -> None:
    covered = [f for s in SETTINGS for f in s.fields]
    assert sorted(covered) == sorted(f.name for f in fields(LaunchConfig)), "a field with no row, or two rows"
    assert len({s.label for s in SETTINGS}) == len(SETTINGS)


def test_every_environment_setting_a_user_sets_is_decided_once() -> None:
    """Each variable ckptless/environment.py reads, and the two the workers read themselves."""
    labels = [s.label for s in ENV_SETTINGS]
    assert sorted(labels) == sorted({*VARIABLES, "CKPTLESS_RECOVERY_TIMEOUT", "CKPTLESS_MIRROR_BUFFERS"})
    assert all(s.value is not None for s in ENV_SETTINGS if s.agree)


def test_the_docs_tables_are_the_code_tables() -> None:
    text = DOCS.read_text()
    section = text.split("## Settings every agent must agree on", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| (\*\*must agree\*\*|per node) \| (.+) \|$", section, re.M)
    assert [(label, kind == "**must agree**", why) for label, kind, why in rows] == \
        [(s.label, s.agree, s.why) for s in (*SETTINGS, *ENV_SETTINGS)]


def test_every_must_agree_setting_has_a_case_here() -> None:
    assert set(AGREE_CASES) | {"script arguments"} == {s.label for s in SETTINGS if s.agree}
    assert set(ENV_AGREE_CASES) == {s.label for s in ENV_SETTINGS if s.agree}


@pytest.mark.parametrize("label", sorted(AGREE_CASES) + sorted(ENV_AGREE_CASES))
def test_a_must_agree_setting_that_differs_is_refused_naming_it_both_values_and_the_opener(label: str) -> None:
    job = conf()
    mine = conf(env=ENV_AGREE_CASES[label]) if label in ENV_AGREE_CASES else conf(*AGREE_CASES[label])
    with pytest.raises(ConfigMismatch) as err:
        check_agreement(job, mine, "node n0 on 10.0.0.1")
    line = str(err.value)
    assert "\n" not in line and isinstance(err.value, ConfigError)  # exit 2 and one line, as any bad flag
    assert err.value.field == label
    assert (f"{label}: the agent that opened the round (node n0 on 10.0.0.1) uses {job[label]!r}, "
            f"this agent {mine[label]!r}") in line, line
    assert "Settings every agent must agree on" in line


def test_other_script_arguments_and_other_script_bytes_are_named(tmp_path: Path) -> None:
    job = conf()
    with pytest.raises(ConfigMismatch, match=re.escape(
            "script arguments: the agent that opened the round uses ['--lr', '0.1'], this agent ['--lr', '0.5']")):
        check_agreement(job, conf(args=("--lr", "0.5")))
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    before = conf(script=str(script))
    script.write_text("print(2)\n")  # same path, other bytes: another program
    diffs = config_disagreement(before, conf(script=str(script)))
    assert [k for k, _, _ in diffs] == ["script"] and all("sha256" in str(v) for v in diffs[0][1:]), diffs


def test_several_differences_are_all_named_in_one_line() -> None:
    with pytest.raises(ConfigMismatch) as err:
        check_agreement(conf(), conf("--replicas", "2", "--mirror-every", "4"), "node n0 on h")
    assert [d[0] for d in err.value.diffs] == ["--replicas", "--mirror-every"]
    assert ("--replicas: the agent that opened the round (node n0 on h) uses 1, this agent 2; "
            "--mirror-every: that agent uses 1, this agent 4") in str(err.value)


def test_paths_are_compared_absolute_and_normalised(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding: --snapshot-dir and the script were compared as raw strings; ``/snaps/`` refused ``/snaps``."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print(1)\n")
    (tmp_path / "sub").mkdir()
    same_dirs = [("--snapshot-dir", d) for d in ("/snaps", "/snaps/", "/snaps/./", "/x/../snaps")]
    assert all(config_disagreement(conf(*same_dirs[0]), conf(*d)) == [] for d in same_dirs)
    assert config_disagreement(conf("--snapshot-dir", "snaps"), conf("--snapshot-dir", str(tmp_path / "snaps/"))) == []
    scripts = ("train.py", "./train.py", str(tmp_path / "train.py"), f"{tmp_path}/sub/../train.py")
    assert all(config_disagreement(conf(script=scripts[0]), conf(script=s)) == [] for s in scripts)
    assert [d[0] for d in config_disagreement(conf(), conf("--snapshot-dir", "/snaps2"))] == ["--snapshot-dir"]


def test_environment_settings_compare_as_the_processes_use_them() -> None:
    """An unset variable and its default written out agree (the processes use the same value)."""
    assert config_disagreement(conf(env={}), conf(env={"CKPTLESS_SEED": str(DEFAULT_SEED),
                                                        "CKPTLESS_COLLECTIVE_TIMEOUT": "60",
                                                        "CKPTLESS_CPU_BACKEND": "gloo",
                                                        "CKPTLESS_MIRROR_BUFFERS": "2"})) == []
    assert config_disagreement(conf(env={"CKPTLESS_COLLECTIVE_TIMEOUT": "30"}),
                               conf(env={"CKPTLESS_COLLECTIVE_TIMEOUT": "30.0"})) == []
    assert [d[0] for d in config_disagreement(conf(), conf(env={"CKPTLESS_SEED": "1", "CKPTLESS_MIRROR_BUFFERS": "1"}))] \
        == ["CKPTLESS_SEED", "CKPTLESS_MIRROR_BUFFERS"]


@pytest.mark.parametrize("flags", PER_NODE, ids=lambda f: f[0])
def test_settings_that_may_differ_per_node_are_not_refused(flags: tuple[str, ...]) -> None:
    assert config_disagreement(conf(), conf(*flags)) == []


@pytest.mark.parametrize("env", ENV_PER_NODE, ids=lambda e: next(iter(e)))
def test_environment_settings_that_may_differ_per_node_are_not_refused(env: dict[str, str]) -> None:
    assert config_disagreement(conf(), conf(env=env)) == []


def test_a_setting_only_one_side_records_decides_nothing() -> None:
    """An agent of another ckptless version records other settings: only the common ones are compared."""
    assert config_disagreement({"--replicas": 1, "new": 3}, {"--replicas": 1}) == []
    assert config_disagreement({}, conf("--replicas", "2")) == []


# --- the rendezvous -----------------------------------------------------------------------------------------
def node(i: int, nproc: int = 2) -> NodeInfo:
    return NodeInfo(f"n{i}", "127.0.0.1", nproc)


ONE, TWO = {"--replicas": 1, "script": "t.py"}, {"--replicas": 2, "script": "t.py"}


def test_the_round_records_its_first_agents_settings_and_name_and_keeps_them() -> None:
    opened = decide_join(None, node(0), 2, 2, {"n0"}, ONE)
    assert opened is not None and opened.config == ONE and opened.opener == "node n0 on 127.0.0.1"
    joined = decide_join(opened, node(1), 2, 2, {"n0", "n1"}, ONE)
    assert joined is not None and joined.config == ONE and joined.opener == opened.opener
    closed = decide_close(joined, {"n0", "n1"}, False)
    assert closed is not None and closed.opener == opened.opener
    assert RoundState.from_bytes(closed.to_bytes()) == closed


def test_a_joiner_that_disagrees_is_refused_naming_the_agent_that_opened_the_round() -> None:
    """Finding: when the agent started wrong came first, the healthy one was told "the job: 2" as if the
    job were right; the line names the opener's node and host, and this agent's value as its own."""
    opened = decide_join(None, node(0), 2, 2, {"n0"}, TWO)  # the agent started wrong, first
    assert opened is not None
    with pytest.raises(ConfigMismatch, match=re.escape(
            "--replicas: the agent that opened the round (node n0 on 127.0.0.1) uses 2, this agent 1")):
        decide_join(opened, node(1), 2, 2, {"n0", "n1"}, ONE)


def test_a_late_agent_that_disagrees_is_refused_not_made_spares_and_other_nproc_still_serves() -> None:
    closed = RoundState(0, "closed", (node(0), node(1)), 2, 2, ONE)
    with pytest.raises(ConfigMismatch):
        decide_join(closed, node(2), 2, 2, {"n0", "n2"}, TWO)
    with pytest.raises(RendezvousLate):  # another --nproc-per-node only: it serves as that many spares
        decide_join(closed, node(2, nproc=4), 2, 2, {"n0", "n2"}, ONE)
    full = RoundState(0, "joining", (node(0), node(1)), 1, 2, ONE)
    with pytest.raises(ConfigMismatch):
        decide_join(full, node(2), 1, 2, {"n0", "n1", "n2"}, TWO)


def test_a_new_round_takes_its_first_agents_settings() -> None:
    """A relaunch (every agent of the old round gone), or a round whose joiners all died, may change them."""
    gone = RoundState(3, "closed", (node(0), node(1)), 2, 2, ONE)
    fresh = decide_join(gone, node(5), 2, 2, {"n5"}, TWO)
    assert fresh is not None and fresh.round == 4 and fresh.config == TWO and fresh.opener == "node n5 on 127.0.0.1"
    dead = RoundState(4, "joining", (node(5),), 2, 2, TWO)
    again = decide_join(dead, node(6), 2, 2, {"n6"}, ONE)
    assert again is not None and again.ids() == ["n6"] and again.config == ONE and "n6" in again.opener


def test_a_round_written_before_settings_were_recorded_parses_and_checks_nothing() -> None:
    old = b'{"max_nodes": 2, "min_nodes": 2, "participants": [], "round": 0, "state": "joining"}'
    st = RoundState.from_bytes(old)
    assert st.config == {} and st.opener == ""
    st.check(TWO)


# --- an agent after the job's end, or beside a live round ----------------------------------------------------
FAILED = JobStatus("failed", "no replacement within 8s (--replacement-timeout):\nranks [2, 3]")
DONE = JobStatus("succeeded", "all 4 ranks finished")
RUN = RoundState(2, "closed", (node(0), node(1)), 2, 2, ONE, "node n0 on 127.0.0.1")


def rec(status: JobStatus | None, live: set[str] = frozenset(), state: RoundState | None = RUN,  # type: ignore[assignment]
        run_round: int | None = 2) -> Records:
    return Records(state, run_round, status, frozenset(live))


def decide(r: Records, mine: dict[str, Any] = ONE, identity: bool = True, restartable: bool = False) -> str:
    return decide_admission(r, mine, identity=identity, restartable=restartable)


def test_the_end_is_one_line_with_the_outcome_and_its_exit_code() -> None:
    line = ended_message("j", FAILED, restartable=False)
    assert "\n" not in line and "it failed (no replacement within 8s (--replacement-timeout): ranks [2, 3])" in line
    assert "exits 1" in line and "new --rdzv-id" in line
    assert ended_message("j", DONE, restartable=True).endswith(
        "it succeeded (all 4 ranks finished); there is nothing to join, so this agent exits 0 (to train again, "
        "use a new --rdzv-id)")
    ok, bad = JobAlreadyEnded("x", succeeded=True), JobAlreadyEnded("x", succeeded=False)
    assert ok.exit_code == 0 and bad.exit_code == 1


def test_a_relaunch_that_does_not_form_in_its_window_ends_with_the_jobs_end() -> None:
    gave_up = Relaunch(FAILED, 11.0, "").gave_up("j", "1 of 2..2 node(s) came")
    line = str(gave_up)
    assert gave_up.exit_code == 1 and "\n" not in line
    assert line.startswith("job 'j' has already ended: it failed (no replacement within 8s")
    assert "no relaunch of it formed within 11s (1 of 2..2 node(s) came)" in line
    assert "restart_timeout" in line and "new --rdzv-id" in line


def test_the_restart_window_is_the_last_call_and_a_few_seconds_unless_set() -> None:
    assert restart_window(cfg()) == 1.0 + 10.0
    assert restart_window(cfg("--rdzv-conf", "last_call_timeout=3")) == 13.0
    assert restart_window(cfg("--rdzv-conf", "restart_timeout=120,join_timeout=900")) == 120.0
    with pytest.raises(ConfigError, match="restart_timeout"):
        cfg("--rdzv-conf", "restart_timeout=soon")


def test_the_admission_in_its_cases() -> None:
    # no run has ended: the rendezvous, unless a live round holds other settings (checked before any write)
    assert decide(rec(None)) == "join"
    assert decide(rec(None, {"n0"})) == "join"  # a late agent of a live job: it serves as spares
    assert decide(rec(None, {"n0"}), TWO) == "mismatch"
    assert decide(rec(None, {"n0"}, RoundState(0, "joining", (node(0),), 2, 2, ONE)), TWO) == "mismatch"
    assert decide(rec(None, set()), TWO) == "join"  # a relaunch after a crash may change settings
    # finding 3: the run is over and this agent has its settings
    assert decide(rec(FAILED)) == "ended"
    assert decide(rec(DONE)) == "ended"
    assert decide(rec(FAILED, {"n1"}), restartable=True) == "ended"  # its agents are still leaving
    assert decide(rec(FAILED, {"n1"}, run_round=None)) == "ended"  # a run without recovery
    # review finding 1: a succeeded run is over whatever the flags (its snapshots, --fresh-start)
    assert decide(rec(DONE), restartable=True) == "ended"
    # a failed run may be relaunched from disk (or from step 0 with --fresh-start), settings changed or not
    assert decide(rec(FAILED), restartable=True) == "relaunch"
    assert decide(rec(FAILED), TWO, restartable=True) == "relaunch"
    forming = RoundState(3, "joining", (node(7),), 2, 2, ONE)
    assert decide(rec(FAILED, {"n7"}, forming)) == "relaunch"  # take part in it: bounded like its opener
    assert decide(rec(FAILED, {"n7"}, forming), TWO) == "mismatch"
    assert decide(rec(FAILED, set(), forming)) == "ended"  # a relaunch whose agents gave up
    assert decide(rec(DONE, {"n7"}, forming)) == "ended"  # a round beside a succeeded run relaunches nothing
    newer = RoundState(3, "closed", (node(7),), 1, 1, ONE)
    assert decide(rec(FAILED, {"n7"}, newer)) == "join"  # a relaunch started: late to it
    assert decide(rec(FAILED, set(), newer)) == "ended"  # a relaunch that never started
    # review finding 2: another job under the id of an ended run (or the script edited)
    assert decide(rec(DONE), TWO) == "other_run"
    assert decide(rec(DONE), TWO, restartable=True) == "other_run"
    assert decide(rec(FAILED), TWO) == "other_run"
    assert decide(rec(DONE, {"n0"}), TWO) == "other_run"  # its agents still leaving
    # --rdzv-id none on an external etcd: no identity, so never an ended run's
    for status in (DONE, FAILED):
        assert decide(rec(status), TWO, identity=False) == "join"
        assert decide(rec(status), identity=False, restartable=True) == "join"
        assert decide(rec(status, {"n0"}), TWO, identity=False) == "mismatch"


@given(st.sampled_from(["joining", "closed"]), st.integers(0, 3), st.one_of(st.none(), st.integers(0, 3)),
       st.sampled_from([None, FAILED, DONE]), st.sets(st.sampled_from(["n0", "n1", "x"])),
       st.sampled_from([ONE, TWO]), st.booleans(), st.booleans())
def test_the_admission_never_starts_what_it_may_not(state: str, rnd: int, run_round: int | None,
                                                    status: JobStatus | None, live: set[str], mine: dict[str, Any],
                                                    restartable: bool, identity: bool) -> None:
    rs = RoundState(rnd, state, (node(0), node(1)), 2, 2, ONE)
    r = Records(rs, run_round, status, frozenset(live))
    got = decide_admission(r, mine, identity=identity, restartable=restartable)
    if r.live and mine != ONE:
        assert got in ("mismatch", "other_run")  # never beside a live round with other settings: exit 2
    if status is None or not identity:
        assert got in ("join", "mismatch")  # no ended run (or no identity): the rendezvous as ever
        return
    if status.state == "succeeded":
        assert got != "relaunch"  # nothing trains a finished job again
    if got == "relaunch":
        assert status.state == "failed" and (restartable or (r.live and state == "joining"))
    if not r.live:
        assert got in ("ended", "other_run", "relaunch")  # nobody live: no round to take part in
        assert (got == "other_run") == (mine != ONE and got != "relaunch")


def test_only_a_node_with_ranks_and_fresh_start_or_the_jobs_snapshots_starts_it_again(tmp_path: Path) -> None:
    snaps = tmp_path / "snaps"
    with_dir = ("--snapshot-dir", str(snaps))
    assert not can_restart(cfg(*with_dir))  # no snapshot of the job there
    assert can_restart(cfg(*with_dir, "--fresh-start"))
    assert not can_restart(cfg(*with_dir, "--fresh-start", "--nproc-per-node", "0", "--spares", "1"))
    step = snaps / "j" / "step_00000004"
    step.mkdir(parents=True)
    (step / "COMPLETE.json").write_text("{}")
    assert can_restart(cfg(*with_dir))


def test_errors_of_another_run_and_of_a_timeout_say_what_they_carry() -> None:
    err = OtherRunSettings("j", "succeeded: all 4 ranks finished", [("--replicas", 1, 2)])
    assert isinstance(err, ConfigError) and "\n" not in str(err)  # exit 2, one line
    assert str(err) == ("job 'j' ended before (succeeded: all 4 ranks finished); this --rdzv-id belongs to an "
                        "ended run with other settings (--replicas: the run used 1, this agent 2): use a new --rdzv-id")
    assert RendezvousTimeout("x", "1 of 2..2 node(s) came").seen == "1 of 2..2 node(s) came"
