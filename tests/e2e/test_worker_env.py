"""Worker environment and command line: unit tests, and a comparison with real torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from ckptless.launcher import worker_env as W
from ckptless.launcher.args import parse_args

from ckptless.errors import ConfigError
from ckptless.worker import nccl_env

from ..harness.repo import SCRIPTS

DUMP = SCRIPTS / "dump_env.py"
# torchrun's values that legitimately differ between two launches.
VOLATILE = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE"}


def _layout(**kw: object) -> W.WorkerLayout:
    base: dict[str, object] = {"node_rank": 1, "nnodes": 3, "nproc": 2, "master_addr": "h0", "master_port": 1234,
                               "run_id": "job"}
    base.update(kw)
    return W.WorkerLayout.uniform(**base)


def test_ranks_and_sizes() -> None:
    env = W.torchrun_env(_layout(restart_count=2, max_restarts=5), 1, {})
    assert env["RANK"] == "3" and env["LOCAL_RANK"] == "1" and env["ROLE_RANK"] == "3"
    assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["ROLE_WORLD_SIZE"]) == ("6", "2", "6")
    assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == ("1", "3")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["TORCHELASTIC_RUN_ID"]) == ("h0", "1234", "job")
    assert (env["TORCHELASTIC_RESTART_COUNT"], env["TORCHELASTIC_MAX_RESTARTS"]) == ("2", "5")
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True" and env["ROLE_NAME"] == "default"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2" and env["TORCHELASTIC_ERROR_FILE"] == ""  # torchrun: 1
    assert set(env) == set(W.TORCHRUN_VARS) | {"OMP_NUM_THREADS"}


def test_nonuniform_layout_and_roles() -> None:
    lay = W.WorkerLayout(node_rank=1, nnodes=2, nproc_per_node=3, rank_offset=1, world_size=4, master_addr="a",
                         master_port=1, run_id="r", role="trainer", role_rank_offset=0, role_world_size=3)
    env = W.torchrun_env(lay, 2, {})
    assert (env["RANK"], env["ROLE_RANK"], env["ROLE_WORLD_SIZE"], env["ROLE_NAME"]) == ("3", "2", "3", "trainer")


@pytest.mark.parametrize("kw", [{"nproc_per_node": 0}, {"node_rank": 3}, {"rank_offset": 5, "world_size": 6}])
def test_invalid_layout(kw: dict[str, int]) -> None:
    base: dict[str, object] = {"node_rank": 1, "nnodes": 3, "nproc_per_node": 2, "rank_offset": 2, "world_size": 6,
                               "master_addr": "h", "master_port": 1, "run_id": "r"}
    base.update(kw)
    with pytest.raises(ConfigError):
        W.WorkerLayout(**base)


def test_local_rank_out_of_range() -> None:
    with pytest.raises(ConfigError):
        W.torchrun_env(_layout(), 2, {})


def test_parent_values_are_inherited_like_torchrun() -> None:
    parent = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0", "OMP_NUM_THREADS": "4", "CUDA_VISIBLE_DEVICES": "2,3"}
    env = W.torchrun_env(_layout(), 0, parent, error_file="/x/error.json")
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0" and env["OMP_NUM_THREADS"] == "4"
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["TORCHELASTIC_ERROR_FILE"] == "/x/error.json"


def test_omp_rule() -> None:
    assert W.omp_num_threads(1, {}) is None and not W.omp_warning_needed(1, {})
    assert W.omp_num_threads(2, {}) == "1" and W.omp_warning_needed(2, {})
    assert W.omp_num_threads(2, {"OMP_NUM_THREADS": "8"}) == "8"
    assert "OMP_NUM_THREADS" not in W.torchrun_env(_layout(nproc=1), 0, {})


def test_virtual_local_rank() -> None:
    lay = _layout(virtual_local_rank=True)
    assert W.torchrun_env(lay, 1, {})["LOCAL_RANK"] == "0"
    assert W.torchrun_env(lay, 1, {})["CUDA_VISIBLE_DEVICES"] == "1"
    assert W.torchrun_env(lay, 1, {"CUDA_VISIBLE_DEVICES": "4, 6"})["CUDA_VISIBLE_DEVICES"] == "6"
    with pytest.raises(ConfigError):
        W.torchrun_env(lay, 1, {"CUDA_VISIBLE_DEVICES": "4"})


def test_worker_env_precedence() -> None:
    parent = {"PATH": "/bin", "RANK": "99", "CKPTLESS_JOB_ID": "stale"}
    env = W.worker_env(_layout(), 0, parent, {"CKPTLESS_JOB_ID": "j", "CKPTLESS_GENERATION": "4"})
    assert env["PATH"] == "/bin" and env["RANK"] == "2"
    assert env["CKPTLESS_JOB_ID"] == "j" and env["CKPTLESS_GENERATION"] == "4"
    with pytest.raises(ConfigError):
        W.worker_env(_layout(), 0, parent, {"RANK": "0"})
    assert parent["RANK"] == "99"  # pure: the input is not modified


def test_ckptless_env_from_config() -> None:
    cfg = parse_args(["--replicas", "2", "--goodput-dir", "/g", "--job-id", "J", "t.py"], environ={})
    env = W.ckptless_env_from_config(cfg, etcd_endpoint="e:2379", node_id="n0", generation=3,
                                     extra={"CKPTLESS_STORE": "x"})
    assert env["CKPTLESS_JOB_ID"] == "J" and env["CKPTLESS_REPLICAS"] == "2"
    assert env["CKPTLESS_GENERATION"] == "3" and env["CKPTLESS_GOODPUT_DIR"] == "/g"
    assert env["CKPTLESS_STORE"] == "x" and "CKPTLESS_SNAPSHOT_DIR" not in env
    assert all(k.startswith("CKPTLESS_") for k in env)


def test_build_command() -> None:
    py = "/py"
    assert W.build_command("t.py", ["a"], python=py) == [py, "-u", "t.py", "a"]
    assert W.build_command("m", ["a"], module=True, python=py) == [py, "-u", "-m", "m", "a"]
    assert W.build_command("/bin/echo", ["a"], no_python=True, python=py) == ["/bin/echo", "a"]
    assert W.build_command("/t.py", ["a"], run_path=True, no_python=True, python=py)[:3] == [py, "-u", "-c"]
    with pytest.raises(ConfigError):
        W.build_command("m", [], module=True, no_python=True)
    assert W.python_executable({"PYTHON_EXEC": "/other"}) == "/other"
    assert W.python_executable({}) == sys.executable


def test_command_from_config() -> None:
    cfg = parse_args(["-m", "pkg.train", "--x", "1"], environ={})
    assert W.command_from_config(cfg, {}) == [sys.executable, "-u", "-m", "pkg.train", "--x", "1"]
    assert W.build_command(cfg) == W.command_from_config(cfg, {})
    assert W.command_from_config(cfg, {"PYTHON_EXEC": "/py2"})[0] == "/py2"


@pytest.mark.parametrize("arg", ["--local-rank=${local_rank}", "a$$b", "$HOME", "${other}", "plain"])
def test_local_rank_macro_matches_torch(arg: str) -> None:
    from torch.distributed.elastic.utils.api import macros

    assert W.substitute_local_rank([arg], 3) == macros.substitute([arg], "3")


def test_run_path_command_runs_script(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("import sys, json\nprint(json.dumps([__name__, sys.argv]))\n")
    argv = W.build_command(str(script), ["x", "--y"], run_path=True)
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout
    assert json.loads(out) == ["__main__", [str(script), "x", "--y"]]


def _run_torchrun(tmp_path: Path, parent: dict[str, str], flags: list[str]) -> dict[int, dict[str, str]]:
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *flags,
           str(DUMP), str(out)]
    proc = subprocess.run(cmd, env=parent, capture_output=True, text=True, timeout=150, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r: json.loads((out / f"env_rank{r}.json").read_text()) for r in (0, 1)}


def _parent_env() -> dict[str, str]:
    # LANG avoids Python's C-locale coercion adding LC_CTYPE (an interpreter effect, not torchrun's).
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": os.environ.get("HOME", "/tmp"),
            "LANG": "C.UTF-8", "CKPTLESS_TEST_MARKER": "1"}


@pytest.mark.parametrize("variant", ["defaults", "inherited"])
def test_same_environment_as_real_torchrun(tmp_path: Path, variant: str) -> None:
    parent = _parent_env()
    flags: list[str] = []
    kw: dict[str, object] = {}
    if variant == "inherited":
        parent |= {"OMP_NUM_THREADS": "3", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
        flags = ["--role", "trainer", "--max-restarts", "2", "--log-dir", str(tmp_path / "logs")]
        kw = {"role": "trainer", "max_restarts": 2}
    dumped = _run_torchrun(tmp_path, parent, flags)
    for local_rank, theirs in dumped.items():
        layout = W.WorkerLayout.uniform(node_rank=0, nnodes=1, nproc=2, master_addr="localhost",
                                        master_port=int(theirs["MASTER_PORT"]),
                                        run_id=theirs["TORCHELASTIC_RUN_ID"], **kw)
        ours = W.worker_env(layout, local_rank, parent, error_file=f"/elsewhere/attempt_0/{local_rank}/error.json")
        # Beyond torchrun's: torch's NCCL settings that keep a recovery's processes alive (worker/nccl_env.py).
        added = {s.name for s in nccl_env.SETTINGS} - set(parent) - {"TORCH_NCCL_ASYNC_ERROR_HANDLING"}
        assert set(theirs) == set(ours) - added, set(theirs) ^ (set(ours) - added)
        assert all(ours[k] == s.value for s in nccl_env.SETTINGS if (k := s.name) in added)
        for key in set(theirs) - VOLATILE - {"TORCH_NCCL_ASYNC_ERROR_HANDLING"}:
            assert theirs[key] == ours[key], key
        # The one deliberate difference: torchrun's default 1 tears a failure's survivors down; ours is 2.
        want = parent.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        assert (theirs["TORCH_NCCL_ASYNC_ERROR_HANDLING"], ours["TORCH_NCCL_ASYNC_ERROR_HANDLING"]) == (
            parent.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"), want)
        assert theirs["TORCHELASTIC_ERROR_FILE"].endswith(f"attempt_0/{local_rank}/error.json")
        assert set(W.torchrun_env(layout, local_rank, parent)) - set(parent) == set(theirs) - set(parent)


def test_ckptless_env_from_config_carries_every_path_flag_absolute_and_recovery_off() -> None:
    cfg = parse_args(["--replicas", "1", "--shm-dir", "rel/shm", "--snapshot-dir", "snaps", "--snapshot-every", "4",
                      "--local-addr", "10.0.0.5", "--hang-timeout", "30", "t.py"], environ={})
    env = W.ckptless_env_from_config(cfg, etcd_endpoint="e", node_id="n", generation=0)
    assert env["CKPTLESS_SHM_DIR"] == os.path.abspath("rel/shm") and env["CKPTLESS_LOCAL_ADDR"] == "10.0.0.5"
    assert env["CKPTLESS_SNAPSHOT_DIR"] == os.path.abspath("snaps") and env["CKPTLESS_SNAPSHOT_EVERY"] == "4"
    assert env["CKPTLESS_HANG_TIMEOUT"] == "30.0" and env["CKPTLESS_REPLICAS"] == "1"
    off = W.ckptless_env_from_config(cfg, etcd_endpoint="e", node_id="n", generation=0, recovery=False)
    assert off["CKPTLESS_REPLICAS"] == "0"


@pytest.mark.parametrize("mode", ["1", "3", "yes"])
def test_an_nccl_mode_that_tears_survivors_down_is_refused(mode: str) -> None:
    """torchrun's 1 (and 3) let torch's watchdog kill a failure's survivors with the replicas they hold."""
    with pytest.raises(ConfigError, match="TORCH_NCCL_ASYNC_ERROR_HANDLING"):
        W.torchrun_env(_layout(), 0, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": mode})
