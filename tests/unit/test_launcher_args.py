"""ckptless-run's command line: torchrun compatibility, validation, PET_* fallbacks."""

from __future__ import annotations

import argparse
import dataclasses
import os
import uuid

import pytest
from ckptless.launcher import args as A

from ckptless.errors import ConfigError

torch_run = pytest.importorskip("torch.distributed.run")

# Documented departures from torchrun's defaults (docs/launcher.md).
DIFFERENT_DEFAULTS = {"rdzv_backend": ("static", "ckptless")}


@pytest.fixture(autouse=True)
def _no_pet(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("PET_") or key == "TORCH_ELASTIC_SHUTDOWN_TIMEOUT":
            monkeypatch.delenv(key)


def _torch_actions() -> list[argparse.Action]:
    return [a for a in torch_run.get_args_parser()._actions if not isinstance(a, argparse._HelpAction)]


TORCH_OPTIONS = [(s, a.dest) for a in _torch_actions() for s in a.option_strings]
TORCH_POSITIONALS = [a.dest for a in _torch_actions() if not a.option_strings]


def _ours_by_option() -> dict[str, argparse.Action]:
    return {s: a for a in A.build_parser({})._actions for s in a.option_strings}


@pytest.mark.parametrize("option,dest", TORCH_OPTIONS)
def test_every_torchrun_option_exists_with_same_semantics(option: str, dest: str) -> None:
    theirs = {s: a for a in _torch_actions() for s in a.option_strings}[option]
    ours = _ours_by_option().get(option)
    assert ours is not None, f"ckptless-run lacks torchrun option {option}"
    assert ours.dest == theirs.dest
    assert ours.nargs == theirs.nargs
    assert ours.choices == theirs.choices
    assert ours.required == theirs.required
    assert set(theirs.option_strings) <= set(ours.option_strings)
    if dest in DIFFERENT_DEFAULTS:
        assert (theirs.default, ours.default) == DIFFERENT_DEFAULTS[dest]
    else:
        assert ours.default == theirs.default
    if theirs.type in (int, float, str):
        assert ours.type is theirs.type


@pytest.mark.parametrize("dest", TORCH_POSITIONALS)
def test_positionals_match(dest: str) -> None:
    theirs = next(a for a in _torch_actions() if a.dest == dest)
    ours = next(a for a in A.build_parser({})._actions if a.dest == dest)
    assert (ours.nargs, ours.option_strings) == (theirs.nargs, theirs.option_strings)


SAMPLES = [
    ({}, ["--nproc-per-node", "2", "train.py", "--lr", "0.1"]),
    ({}, ["--nproc_per_node=3", "--max_restarts", "4", "-m", "pkg.train", "x"]),
    ({"PET_NPROC_PER_NODE": "4", "PET_MAX_RESTARTS": "2", "PET_MONITOR_INTERVAL": "0.5"}, ["t.py"]),
    ({"PET_NPROC_PER_NODE": "4"}, ["--nproc-per-node", "1", "t.py"]),  # the command line wins
    ({"PET_STANDALONE": "1", "PET_NO_PYTHON": "1", "PET_RDZV_ID": "job7"}, ["/bin/true"]),
    ({"PET_STANDALONE": "0", "PET_NNODES": "2:4", "PET_RDZV_ENDPOINT": "etcd:2379"}, ["t.py"]),
    ({"PET_REDIRECTS": "3", "PET_TEE": "0:1", "PET_LOG_DIR": "/tmp/l"}, ["-r", "1", "t.py"]),
    ({"PET_DUPLICATE_STDOUT_FILTERS": "a,,b,c"}, ["t.py"]),
    ({"PET_SHUTDOWN_TIMEOUT": "7", "PET_MASTER_PORT": "1234"}, ["--local-addr", "h", "t.py"]),
]


@pytest.mark.parametrize("environ,argv", SAMPLES)
def test_namespace_equals_torchruns(environ: dict[str, str], argv: list[str],
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Same argv and PET_* environment -> same values as torchrun's own parser."""
    for k, v in environ.items():
        monkeypatch.setenv(k, v)
    theirs = vars(torch_run.get_args_parser().parse_args(argv))
    ours = vars(A.build_parser(environ).parse_args(argv))
    for dest, value in theirs.items():
        if dest not in DIFFERENT_DEFAULTS:
            assert ours[dest] == value, dest


def test_pet_fallbacks_resolve_into_config() -> None:
    env = {"PET_NPROC_PER_NODE": "3", "PET_NNODES": "2:4", "PET_RDZV_ENDPOINT": "etcd-host",
           "PET_RDZV_ID": "j1", "PET_MAX_RESTARTS": "5", "PET_REPLICAS": "2", "PET_LEASE_TTL": "0.5"}
    cfg = A.parse_args(["t.py"], environ=env)
    assert (cfg.nproc_per_node, cfg.min_nodes, cfg.max_nodes) == (3, 2, 4)
    assert cfg.rdzv_endpoint == A.Endpoint("etcd-host", 2379)
    assert (cfg.run_id, cfg.max_restarts, cfg.replicas, cfg.lease_ttl) == ("j1", 5, 2, 0.5)


def test_pet_flag_must_be_integer() -> None:
    with pytest.raises(ConfigError) as ei:
        A.build_parser({"PET_STANDALONE": "yes"})
    assert ei.value.field == "PET_STANDALONE"


def test_defaults_resolve() -> None:
    cfg = A.parse_args(["train.py", "--epochs", "3"], environ={})
    assert (cfg.min_nodes, cfg.max_nodes, cfg.nproc_per_node) == (1, 1, 1)
    assert cfg.rdzv_backend == "ckptless" and cfg.embedded_etcd
    uuid.UUID(cfg.run_id)  # single node, no id: a fresh one like torchrun's implicit c10d
    assert cfg.training_script_args == ("--epochs", "3")
    assert (cfg.replicas, cfg.mirror_every, cfg.placement, cfg.spares, cfg.snapshot_every) == (1, 1, "ring", 0, 0)
    assert cfg.lease_ttl == 2.0 and cfg.hang_timeout is None and cfg.shutdown_timeout == 30.0
    assert cfg.signals_to_handle == ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    assert cfg.redirects == (A.Std.NONE,) and A.unimplemented_flags(cfg) == []
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.replicas = 3


@pytest.mark.parametrize("value,expected", [("1", (1, 1)), ("4", (4, 4)), ("1:4", (1, 4)), ("2:2", (2, 2))])
def test_nnodes_ok(value: str, expected: tuple[int, int]) -> None:
    assert A.parse_nnodes(value) == expected


@pytest.mark.parametrize("value", ["", "a", "1:b", "1:2:3", "0", "3:2", "-1:2", "0:0"])
def test_nnodes_invalid(value: str) -> None:
    with pytest.raises(ConfigError) as ei:
        A.parse_args([f"--nnodes={value}", "--rdzv-endpoint", "h", "t.py"], environ={})
    assert ei.value.field == "nnodes" and ei.value.value == value


def test_nproc_named_values() -> None:
    cpus = len(os.sched_getaffinity(0))
    assert A.resolve_nproc("cpu") == cpus
    assert A.resolve_nproc("auto") == cpus  # no accelerator on CI
    for bad in ("-2", "tpu"):
        with pytest.raises(ConfigError):
            A.resolve_nproc(bad)
    assert A.resolve_nproc("0") == 0  # a spare-only node; parse_args then requires --spares
    with pytest.raises(ConfigError) as err:
        A.parse_args(["--nproc-per-node", "0", "train.py"])
    assert err.value.field == "nproc_per_node"


def test_nproc_gpu_without_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ConfigError, match="CUDA"):
        A.parse_args(["--nproc-per-node", "gpu", "t.py"], environ={})


@pytest.mark.parametrize("value,host,port", [
    ("h", "h", 2379), ("h:1234", "h", 1234), ("10.0.0.1:23", "10.0.0.1", 23), ("[::1]:99", "::1", 99),
    ("[::1]", "::1", 2379), ("::1", "::1", 2379), ("http://e:2380", "e", 2380), ("https://e/", "e", 2379),
])
def test_endpoint_parsing(value: str, host: str, port: int) -> None:
    ep = A.parse_endpoint(value)
    assert (ep.host, ep.port) == (host, port)
    assert A.parse_endpoint(str(ep)) == ep


@pytest.mark.parametrize("value", ["", ":2379", "h:x", "h:0", "h:70000", "[::1", "[::1]x"])
def test_endpoint_invalid(value: str) -> None:
    with pytest.raises(ConfigError) as ei:
        A.parse_endpoint(value)
    assert ei.value.field == "rdzv_endpoint"


def test_standalone() -> None:
    cfg = A.parse_args(["--standalone", "--rdzv-id", "ignored", "--rdzv-endpoint", "x:1", "t.py"], environ={})
    assert cfg.standalone and cfg.embedded_etcd and cfg.rdzv_backend == "ckptless"
    assert cfg.run_id != "ignored"
    uuid.UUID(cfg.run_id)
    with pytest.raises(ConfigError) as ei:
        A.parse_args(["--standalone", "--nnodes", "2", "t.py"], environ={})
    assert ei.value.field == "nnodes"


@pytest.mark.parametrize("backend", ["ckptless", "etcd", "etcd-v2"])
def test_etcd_backends(backend: str) -> None:
    cfg = A.parse_args(["--rdzv-backend", backend, "--rdzv-endpoint", "e:1", "--nnodes", "2",
                        "--job-id", "J", "t.py"], environ={})
    assert (cfg.rdzv_backend, cfg.run_id, str(cfg.rdzv_endpoint)) == ("ckptless", "J", "e:1")


@pytest.mark.parametrize("backend", ["c10d", "zeus", ""])
def test_unsupported_backend(backend: str) -> None:
    with pytest.raises(ConfigError, match="etcd") as ei:
        A.parse_args(["--rdzv-backend", backend, "t.py"], environ={})
    assert ei.value.field == "rdzv_backend"


def test_static_backend_single_node_only() -> None:
    cfg = A.parse_args(["--rdzv-backend", "static", "t.py"], environ={})
    assert cfg.embedded_etcd
    with pytest.raises(ConfigError, match="one node"):
        A.parse_args(["--rdzv-backend", "static", "--nnodes", "2", "t.py"], environ={})


def test_multinode_needs_endpoint() -> None:
    with pytest.raises(ConfigError) as ei:
        A.parse_args(["--nnodes", "1:2", "t.py"], environ={})
    assert ei.value.field == "rdzv_endpoint"


def test_unknown_flag_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ei:
        A.parse_args(["--bogus", "3", "t.py"], environ={})
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unrecognized arguments: --bogus" in err and "Traceback" not in err


def test_flags_after_script_belong_to_script() -> None:
    cfg = A.parse_args(["t.py", "--bogus", "--nnodes", "9"], environ={})
    assert cfg.training_script_args == ("--bogus", "--nnodes", "9") and cfg.max_nodes == 1


@pytest.mark.parametrize("argv,flag", [
    (["--numa-binding", "node"], "--numa-binding"),
    (["--logs-specs", "x"], "--logs-specs"),
    (["--event-log-handler", "console"], "--event-log-handler"),
    (["--duplicate-stdout-filters", "a"], "--duplicate-stdout-filters"),
])
def test_unimplemented_flags_are_refused(argv: list[str], flag: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=flag):
        A.parse_args([*argv, "t.py"], environ={})
    cfg = A.parse_args([*argv, "t.py"], environ={}, allow_unimplemented=True)
    assert A.unimplemented_flags(cfg) == [flag]
    monkeypatch.delitem(A.UNIMPLEMENTED, flag)  # the lead enables a feature by removing its entry
    assert A.unimplemented_flags(A.parse_args([*argv, "t.py"], environ={})) == []


@pytest.mark.parametrize("argv,field", [
    (["--max-restarts", "-1"], "max_restarts"), (["--monitor-interval", "0"], "monitor_interval"),
    (["--replicas", "-1"], "replicas"), (["--mirror-every", "0"], "mirror_every"),
    (["--lease-ttl", "0"], "lease_ttl"), (["--snapshot-every", "5"], "snapshot_dir"),
    (["--hang-timeout", "-1"], "hang_timeout"), (["--spares", "-1"], "spares"),
    (["--redirects", "7"], "redirects"), (["--tee", "0:4"], "tee"), (["--rdzv-conf", "a"], "rdzv_conf"),
    (["--local-ranks-filter", "0,x"], "local_ranks_filter"), (["--signals-to-handle", "SIGFOO"], "signals_to_handle"),
    (["--no-python", "-m"], "module"), (["--run-path"], "training_script"),
])
def test_validation_errors_name_the_field(argv: list[str], field: str) -> None:
    with pytest.raises(ConfigError) as ei:
        A.parse_args([*argv, "t.py"], environ={})
    assert ei.value.field == field


def test_bad_choice_exits_with_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        A.parse_args(["--placement", "star", "t.py"], environ={})
    assert "invalid choice" in capsys.readouterr().err


def test_logs_and_misc_resolution() -> None:
    cfg = A.parse_args(["--nproc-per-node", "3", "-r", "0:3,2:1", "-t", "2", "--local-ranks-filter", "0,2",
                        "--rdzv-conf", "timeout=5, join=x", "--shutdown-timeout", "4", "--placement", "group",
                        "--goodput-dir", "/g", "t.py"], environ={})
    assert cfg.redirects == (A.Std.ALL, A.Std.NONE, A.Std.OUT)
    assert cfg.tee == (A.Std.ERR,) * 3
    assert cfg.local_ranks_filter == frozenset({0, 2})
    assert dict(cfg.rdzv_configs) == {"timeout": "5", "join": "x"}
    assert (cfg.shutdown_timeout, cfg.placement, cfg.goodput_dir) == (4.0, "group", "/g")


def test_shutdown_timeout_from_torch_env() -> None:
    cfg = A.parse_args(["t.py"], environ={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "12"})
    assert cfg.shutdown_timeout == 12.0
    with pytest.raises(ConfigError):
        A.parse_args(["t.py"], environ={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"})


def test_run_path_and_module_flags() -> None:
    cfg = A.parse_args(["--run-path", "/abs/t.py", "a"], environ={})
    assert cfg.run_path and cfg.training_script == "/abs/t.py"
    cfg = A.parse_args(["-m", "pkg.mod"], environ={})
    assert cfg.module and not cfg.no_python


@pytest.mark.parametrize("argv, field", [
    (["--spare-refill", "t.py"], "spare_refill"),
    (["--spare-any-rank", "t.py"], "spare_any_rank"),
    (["--spares", "1", "--no-spare-prebuild", "--spare-any-rank", "t.py"], "spare_any_rank"),
])
def test_spare_options_need_the_spares_they_act_on(argv: list[str], field: str) -> None:
    with pytest.raises(ConfigError) as ei:
        A.parse_args(argv, environ={})
    assert ei.value.field == field


def test_spare_options_parse_and_read_their_env() -> None:
    cfg = A.parse_args(["--spares", "1", "--spare-refill", "--spare-any-rank", "t.py"], environ={})
    assert cfg.spare_refill and cfg.spare_any_rank
    env = A.parse_args(["--spares", "1", "t.py"], environ={"PET_SPARE_REFILL": "1", "PET_SPARE_ANY_RANK": "1"})
    assert env.spare_refill and env.spare_any_rank


def test_the_any_rank_policy_is_kept_without_spares() -> None:
    """An agent that arrives after the job formed serves as spares (launcher/agent.py, _serve_as_spares):
    it keeps the policy it was started with (issue 35: --no-spare-any-rank was ignored there)."""
    assert A.parse_args(["t.py"], environ={}).spare_any_rank
    assert not A.parse_args(["--no-spare-any-rank", "t.py"], environ={}).spare_any_rank
    assert not A.parse_args(["--no-spare-prebuild", "t.py"], environ={}).spare_any_rank


def test_lost_node_shrink_needs_a_node_range() -> None:
    """``--lost-node shrink`` keeps at least MIN nodes: with MIN == MAX it could never shrink (one clear error)."""
    cfg = A.parse_args(["--nnodes", "1:2", "--rdzv-endpoint", "h", "--lost-node", "shrink", "t.py"], environ={})
    assert cfg.lost_node == "shrink" and (cfg.min_nodes, cfg.max_nodes) == (1, 2)
    assert A.parse_args(["--nnodes", "2", "--rdzv-endpoint", "h", "t.py"], environ={}).lost_node == "wait"
    with pytest.raises(ConfigError) as ei:
        A.parse_args(["--nnodes", "2", "--rdzv-endpoint", "h", "--lost-node", "shrink", "t.py"], environ={})
    assert ei.value.field == "lost_node" and "--nnodes MIN:MAX" in str(ei.value)
    with pytest.raises(ConfigError) as ei:
        A.parse_args(["--nnodes", "1:2", "--rdzv-endpoint", "h", "t.py"], environ={"PET_LOST_NODE": "grow"})
    assert ei.value.field == "lost_node" and ei.value.value == "grow"
