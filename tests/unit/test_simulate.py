"""``ckptless simulate``: the model's invariants (pure, hypothesis), the placement analysis held
against brute force and against the simulation, bad input, and the command line's --json."""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptless.cli import main as cli_main
from ckptless.errors import ConfigError
from ckptless.simulate import Params, costs, simulate
from ckptless.simulate.failures import Failure, draw_failures
from ckptless.simulate.model import SYSTEMS
from ckptless.simulate.placement import defeats, p_defeat_given_f, p_defeat_per_failure, surviving_subsets
from ckptless.simulate.policies import run_ckptless, run_restart, run_torchft
from ckptless.simulate.presets import PRESETS, preset

RUNNERS = {"ckptless": run_ckptless, "restart": run_restart, "torchft": run_torchft}

params_st = st.builds(
    Params,
    world=st.sampled_from([4, 8, 16, 24]),
    nproc_per_node=st.just(2),
    state_mib=st.floats(1, 512),
    step_s=st.floats(0.05, 5),
    duration_s=st.floats(30, 2000),
    mtbf_s=st.floats(2, 500),
    mix_software=st.floats(0, 1),
    mix_accelerator=st.floats(0, 1),
    mix_node=st.floats(0.01, 1),
    replicas=st.sampled_from([1, 1, 0]),
    mirror_every=st.integers(1, 10),
    spares=st.integers(0, 6),
    snapshot_every_s=st.sampled_from([0.0, 60.0, 600.0]),
    lost_node=st.sampled_from(["wait", "shrink"]),
    replace_s=st.floats(0, 100),
    defer_in_recovery=st.booleans(),
)


@settings(max_examples=60, deadline=None)
@given(params_st, st.integers(0, 2**31))
def test_goodput_is_a_share_and_the_categories_partition_the_wall_time(p: Params, seed: int) -> None:
    r = simulate(p, seed)
    for name in SYSTEMS:
        s = r[name]
        assert 0.0 <= s.goodput <= 1.0 + 1e-9, (name, s.goodput)
        assert all(v >= -1e-6 for v in s.seconds.values()), (name, s.seconds)
        assert math.isclose(sum(s.seconds.values()), p.duration_s, rel_tol=1e-6), (name, s.seconds)


@settings(max_examples=40, deadline=None)
@given(params_st)
def test_without_failures_goodput_is_one_minus_the_mirror_overhead(p: Params) -> None:
    p = replace(p, mtbf_s=1e12, snapshot_every_s=0.0)
    r = simulate(p, 0)
    assert sum(r.failures.values()) == 0
    assert math.isclose(r["ckptless"].goodput, 1 - p.mirror_overhead, rel_tol=1e-9)
    assert math.isclose(r["torchft"].goodput, 1.0)
    assert math.isclose(r["restart"].goodput, 1 / (1 + p.save_s / p.restart_interval_s), rel_tol=1e-9)
    # with snapshots too: each costs its blocking part once per interval of work
    q = replace(p, mtbf_s=1e12, snapshot_every_s=600.0)
    mirror = q.mirror_block_s / (q.mirror_every * q.step_s)
    assert math.isclose(simulate(q, 0)["ckptless"].goodput, 1 / (1 + mirror + q.snapshot_block_s / 600.0),
                        rel_tol=1e-9)


def test_the_mirror_overhead_alone_matches_the_closed_form() -> None:
    p = Params(mtbf_s=1e12, state_mib=64, mirror_every=3)
    block = p.state_bytes / (p.host_gbps * 1e9) + p.mirror_fixed_s
    assert math.isclose(simulate(p, 1)["ckptless"].goodput, 3 * p.step_s / (3 * p.step_s + block))


@settings(max_examples=60, deadline=None)
@given(params_st.filter(lambda p: not p.defer_in_recovery), st.integers(0, 2**31), st.floats(0, 1), st.data())
def test_one_more_failure_never_raises_goodput(p: Params, seed: int, where: float, data: st.DataObject) -> None:
    base = draw_failures(p, seed)
    extra = Failure(where * p.duration_s, data.draw(st.sampled_from(["software", "accelerator", "node"])),
                    data.draw(st.integers(0, p.nodes - 1)), None)
    if extra.kind != "node":
        extra = replace(extra, local=data.draw(st.integers(0, p.nproc_per_node - 1)))
    more = sorted([*base, extra], key=lambda f: f.t)
    for name, run in RUNNERS.items():
        g0 = run(p, base, p.duration_s).timeline.seconds["productive"]
        g1 = run(p, more, p.duration_s).timeline.seconds["productive"]
        # TorchFT-style: groups that come back together join in one quorum, so a failure that delays a
        # group's return can merge two rejoin stalls into one: it may save at most that one stall
        slack = p.ft_quorum_s + costs.comm_init_s(p, p.ft_groups) if name == "torchft" else 0.0
        assert g1 <= g0 + slack + 1e-6, (name, g0, g1)


@settings(max_examples=25, deadline=None)
@given(params_st, st.integers(0, 2**31))
def test_a_seed_gives_the_same_result_every_time(p: Params, seed: int) -> None:
    a, b = simulate(p, seed), simulate(p, seed)
    assert a == b
    assert draw_failures(p, seed) == draw_failures(p, seed)


def test_a_shorter_mtbf_lowers_the_expected_goodput() -> None:
    def mean(m: float) -> dict[str, float]:
        p = Params(mtbf_s=m, duration_s=600)
        return {s: sum(simulate(p, i)[s].goodput for i in range(30)) / 30 for s in SYSTEMS}

    hi, lo = mean(60), mean(10)
    assert all(lo[s] < hi[s] for s in SYSTEMS), (hi, lo)


# --- placement ---------------------------------------------------------------------------------------------------

def _brute(nodes: int, k: int, f: int, placement: str) -> int:
    p = Params(world=2 * nodes, nproc_per_node=2, replicas=k, placement=placement)
    ok = 0
    for subset in itertools.combinations(range(nodes), f):
        down = [(n, None) for n in subset]
        if not any(defeats(u, [d for d in down if d != u], p) for u in down):
            ok += 1
    return ok


@pytest.mark.parametrize("placement", ["ring", "group"])
@pytest.mark.parametrize("nodes,k", [(4, 1), (6, 1), (6, 2), (8, 1), (9, 2), (8, 3)])
def test_surviving_subsets_match_brute_force_over_the_simulators_own_check(nodes: int, k: int, placement: str) -> None:
    if placement == "group" and nodes % (k + 1):
        pytest.skip("the closed form for groups needs whole groups")
    for f in range(0, nodes + 1):
        assert surviving_subsets(nodes, k, f, placement) == _brute(nodes, k, f, placement), f


def test_gemini_group_formula_for_pairs() -> None:
    # K = 1, groups of 2: no pair both down = C(N/2, f) 2^f of C(N, f) (Gemini's analysis)
    n, f = 100, 5
    assert math.isclose(p_defeat_given_f(n, 1, f, "group"), 1 - math.comb(n // 2, f) * 2**f / math.comb(n, f))
    assert p_defeat_given_f(n, 1, 1, "group") == 0.0
    # ring K = 1 is worse than groups at the same f: more windows contain each node
    assert p_defeat_given_f(n, 1, f, "ring") > p_defeat_given_f(n, 1, f, "group")


def test_gemini_matches_random_subsets() -> None:
    rng = random.Random(5)
    nodes, k, f = 40, 1, 4
    p = Params(world=2 * nodes, nproc_per_node=2, replicas=k)
    trials, hits = 20000, 0
    for _ in range(trials):
        down = [(n, None) for n in rng.sample(range(nodes), f)]
        hits += any(defeats(u, [d for d in down if d != u], p) for u in down)
    assert abs(hits / trials - p_defeat_given_f(nodes, k, f, "ring")) < 0.01


@pytest.mark.parametrize("mix", [(1.0, 0.0, 0.0), (0.0, 0.0, 1.0), (0.3, 0.3, 0.4)])
@pytest.mark.parametrize("placement", ["ring", "group"])
def test_the_simulated_defeat_rate_matches_the_closed_form(mix: tuple[float, float, float], placement: str) -> None:
    """Many failures, correlated node losses included, plenty of spares (each loss unprotected for the
    same window, ~0.75 s, against a job MTBF of 10 s: first order in q = rate x window holds): the share of
    failures that defeat the placement is the closed form's, within 25 % or 3 standard errors."""
    p = Params(world=64, nproc_per_node=4, mtbf_s=10.0, duration_s=4e5, spares=10**6, placement=placement,
               mix_software=mix[0], mix_accelerator=mix[1], mix_node=mix[2], snapshot_every_s=100.0,
               replace_s=0.0, state_mib=1.0, detect_node_s=0.12, contention_s_per_rank=0.0)
    r = simulate(p, 3)
    n = sum(r.failures.values())
    closed = p_defeat_per_failure(p, r.window_s)
    se = math.sqrt(closed * (1 - closed) / n)
    assert abs(r.p_defeat_sim - closed) <= max(0.25 * closed, 3 * se), (r.p_defeat_sim, closed, n, r.window_s)


# --- input and the command line ----------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [("world", 0), ("world", 5), ("step_s", -1.0), ("state_mib", 0.0),
                                         ("placement", "star"), ("lost_node", "hope"), ("mtbf_s", float("nan")),
                                         ("replicas", 2), ("mirror_every", 0), ("ft_group_ranks", 3)])
def test_bad_input_is_one_config_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as e:
        Params(**{field: value})  # type: ignore[arg-type]
    assert e.value.field == field and repr(value) in str(e.value)


def test_every_preset_builds_and_runs_quickly() -> None:
    for name in PRESETS:
        p = preset(name)
        r = simulate(replace(p, duration_s=min(p.duration_s, 2 * 86400)), 0)
        assert 0 < r["ckptless"].goodput <= 1
    with pytest.raises(ConfigError, match="preset"):
        preset("nope")


def test_cli_simulate_json(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "sim.json"
    rc = cli_main(["simulate", "--world", "8", "--nproc-per-node", "2", "--step-s", "0.2", "--state-mib", "16",
                   "--mtbf-s", "30", "--duration-s", "300", "--spares", "2", "--seed", "3", "--seeds", "3",
                   "--json", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    for s in ("ckptless", "restart", "torchft"):
        assert 0 <= doc[s]["goodput"] <= 1
        assert set(doc[s]["badput"]) <= set(doc[s]["seconds"])
    assert doc["recommend"]["replicas"] >= 1 and doc["recommend"]["snapshot_every_s"] >= 0
    assert doc["params"]["world"] == 8 and doc["params"]["spares"] == 2
    assert "p_defeat_per_failure_closed_form" in doc["placement"]
    assert "goodput (mean)" in capsys.readouterr().out


@pytest.mark.parametrize("argv,needle", [(["--world", "x"], "world='x'"), (["--world", "-4"], "world=-4"),
                                         (["--preset", "huge"], "preset='huge'"), (["--set", "nope=1"], "nope="),
                                         (["--mix", "cosmic=1"], "mix=")])
def test_cli_bad_input_is_one_line_and_exit_2(argv: list[str], needle: str, capsys) -> None:  # type: ignore[no-untyped-def]
    assert cli_main(["simulate", "--no-recommend", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1
