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

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptless.coordinator.rendezvous import (NodeInfo, RoundState, check_agreement, config_disagreement,
                                             decide_close, decide_join)
from ckptless.errors import ConfigError, ConfigMismatch, JobEnded, RendezvousLate
from ckptless.launcher.admission import SETTINGS, can_restart, decide_ended, ended_message, job_config
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


def cfg(*flags: str, script: str = "train.py", args: tuple[str, ...] = ("--lr", "0.1")) -> LaunchConfig:
    return parse_args([*BASE, *flags, script, *args], environ={})


def test_every_launch_config_field_is_decided_once() -> None:
    covered = [f for s in SETTINGS for f in s.fields]
    assert sorted(covered) == sorted(f.name for f in fields(LaunchConfig)), "a field with no row, or two rows"
    assert len({s.label for s in SETTINGS}) == len(SETTINGS)


def test_the_docs_table_is_the_code_table() -> None:
    text = DOCS.read_text()
    section = text.split("## Settings every agent must agree on", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([^`]+)` \| (\*\*must agree\*\*|per node) \| (.+) \|$", section, re.M)
    assert [(label, kind == "**must agree**", why) for label, kind, why in rows] == \
        [(s.label, s.agree, s.why) for s in SETTINGS]


def test_every_must_agree_setting_has_a_case_here() -> None:
    assert set(AGREE_CASES) | {"script arguments"} == {s.label for s in SETTINGS if s.agree}


@pytest.mark.parametrize("label", sorted(AGREE_CASES))
def test_a_must_agree_setting_that_differs_is_refused_naming_it_and_both_values(label: str) -> None:
    job, mine = job_config(cfg()), job_config(cfg(*AGREE_CASES[label]))
    with pytest.raises(ConfigMismatch) as err:
        check_agreement(job, mine)
    line = str(err.value)
    assert "\n" not in line and isinstance(err.value, ConfigError)  # exit 2 and one line, as any bad flag
    assert err.value.field == label
    assert f"{label} (this agent: {mine[label]!r}, the job: {job[label]!r})" in line, line
    assert "Settings every agent must agree on" in line


def test_other_script_arguments_and_other_script_bytes_are_named(tmp_path: Path) -> None:
    job = job_config(cfg())
    with pytest.raises(ConfigMismatch, match=re.escape(
            "script arguments (this agent: ['--lr', '0.5'], the job: ['--lr', '0.1'])")):
        check_agreement(job, job_config(cfg(args=("--lr", "0.5"))))
    script = tmp_path / "train.py"
    script.write_text("print(1)\n")
    before = job_config(cfg(script=str(script)))
    script.write_text("print(2)\n")  # same path, other bytes: another program
    diffs = config_disagreement(before, job_config(cfg(script=str(script))))
    assert [k for k, _, _ in diffs] == ["script"] and all("sha256" in str(v) for v in diffs[0][1:]), diffs


def test_several_differences_are_all_named_in_one_line() -> None:
    with pytest.raises(ConfigMismatch) as err:
        check_agreement(job_config(cfg()), job_config(cfg("--replicas", "2", "--mirror-every", "4")))
    assert [d[0] for d in err.value.diffs] == ["--replicas", "--mirror-every"]
    assert "--replicas (this agent: 2, the job: 1) and --mirror-every (this agent: 4, the job: 1)" in str(err.value)


@pytest.mark.parametrize("flags", PER_NODE, ids=lambda f: f[0])
def test_settings_that_may_differ_per_node_are_not_refused(flags: tuple[str, ...]) -> None:
    assert config_disagreement(job_config(cfg()), job_config(cfg(*flags))) == []


def test_a_setting_only_one_side_records_decides_nothing() -> None:
    """An agent of another ckptless version records other settings: only the common ones are compared."""
    assert config_disagreement({"--replicas": 1, "new": 3}, {"--replicas": 1}) == []
    assert config_disagreement({}, job_config(cfg("--replicas", "2"))) == []


# --- the rendezvous -----------------------------------------------------------------------------------------
def node(i: int, nproc: int = 2) -> NodeInfo:
    return NodeInfo(f"n{i}", "127.0.0.1", nproc)


ONE, TWO = {"--replicas": 1, "script": "t.py"}, {"--replicas": 2, "script": "t.py"}


def test_the_round_records_its_first_agents_settings_and_keeps_them() -> None:
    opened = decide_join(None, node(0), 2, 2, {"n0"}, ONE)
    assert opened is not None and opened.config == ONE
    joined = decide_join(opened, node(1), 2, 2, {"n0", "n1"}, ONE)
    assert joined is not None and joined.config == ONE
    closed = decide_close(joined, {"n0", "n1"}, False)
    assert closed is not None and RoundState.from_bytes(closed.to_bytes()) == closed


def test_a_joiner_that_disagrees_is_refused_before_it_joins() -> None:
    opened = RoundState(0, "joining", (node(0),), 2, 2, ONE)
    with pytest.raises(ConfigMismatch, match=r"--replicas \(this agent: 2, the job: 1\)"):
        decide_join(opened, node(1), 2, 2, {"n0", "n1"}, TWO)


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
    assert fresh is not None and fresh.round == 4 and fresh.config == TWO
    dead = RoundState(4, "joining", (node(5),), 2, 2, TWO)
    again = decide_join(dead, node(6), 2, 2, {"n6"}, ONE)
    assert again is not None and again.ids() == ["n6"] and again.config == ONE


def test_a_round_written_before_settings_were_recorded_parses_and_checks_nothing() -> None:
    old = b'{"max_nodes": 2, "min_nodes": 2, "participants": [], "round": 0, "state": "joining"}'
    st = RoundState.from_bytes(old)
    assert st.config == {}
    check_agreement(st.config, TWO)


# --- an agent after the job's end ------------------------------------------------------------------------------
FAILED = JobStatus("failed", "no replacement within 8s (--replacement-timeout):\nranks [2, 3]")
DONE = JobStatus("succeeded", "all 4 ranks finished")


def test_the_end_is_one_line_with_the_outcome_and_its_exit_code() -> None:
    line = ended_message("j", FAILED, restartable=False)
    assert "\n" not in line and "it failed (no replacement within 8s (--replacement-timeout): ranks [2, 3])" in line
    assert "exits 1" in line and "new --rdzv-id" in line
    assert ended_message("j", DONE, restartable=False).endswith("it succeeded (all 4 ranks finished); there is "
                                                                "nothing to join, so this agent exits 0")
    assert JobEnded("x", succeeded=True).exit_code == 0 and JobEnded("x", succeeded=False).exit_code == 1


def test_the_ended_decision_in_its_cases() -> None:
    closed = RoundState(2, "closed", (node(0), node(1)), 2, 2)
    assert decide_ended(closed, 2, None, set(), True) == "join"  # not ended
    assert decide_ended(closed, 2, FAILED, set(), False) == "ended"  # finding 3: every agent gone
    assert decide_ended(closed, 2, DONE, set(), False) == "ended"
    assert decide_ended(closed, 2, FAILED, set(), True) == "restart"  # a relaunch from snapshots
    assert decide_ended(closed, 2, FAILED, {"n1"}, True) == "ended"  # its agents are still leaving
    assert decide_ended(closed, None, FAILED, {"n1"}, False) == "ended"  # a run without recovery
    newer = RoundState(3, "closed", (node(7),), 1, 1)
    assert decide_ended(newer, 2, FAILED, {"n7"}, False) == "join"  # a relaunch starting now
    assert decide_ended(newer, 2, FAILED, set(), False) == "ended"  # a relaunch that never started
    forming = RoundState(3, "joining", (node(7),), 2, 2)
    assert decide_ended(forming, 2, FAILED, {"n7"}, False) == "join"  # take part in the relaunch


@given(st.sampled_from(["joining", "closed"]), st.integers(0, 3), st.one_of(st.none(), st.integers(0, 3)),
       st.sampled_from([None, FAILED, DONE]), st.sets(st.sampled_from(["n0", "n1", "x"])), st.booleans())
def test_the_ended_decision_never_starts_what_it_may_not(state: str, rnd: int, run_round: int | None,
                                                         status: JobStatus | None, live: set[str],
                                                         restartable: bool) -> None:
    rs = RoundState(rnd, state, (node(0), node(1)), 2, 2)
    got = decide_ended(rs, run_round, status, live, restartable)
    if status is None:
        assert got == "join"
    if got == "restart":
        assert restartable and not ({"n0", "n1"} & live)  # never beside a live agent of the round
    if status is not None and not ({"n0", "n1"} & live):
        assert got == ("restart" if restartable else "ended")  # nobody live: no round to take part in


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
