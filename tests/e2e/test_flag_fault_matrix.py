"""Every flag together with a fault: the matrix of tests/harness/flag_matrix.py, read against the parser.

* ``test_every_flag_has_a_fault_case`` fails when a flag of ``build_parser()`` has no row
  (a new flag cannot land without its fault case) or a row names a flag that is gone.
* ``test_flag_job_with_a_kill``: each job carries its rows' flags at once, rank 1 is
  SIGKILLed at step 5, and the run must end bitwise equal to the one fault-free twin
  (or, for ``--replicas 0``, end at once with a clear error and nothing left). CI runs a
  seeded subset of the jobs (``CI_JOBS``, rotating by day); the rest are slow.
* ``test_each_flag_alone_with_a_kill`` (slow): the same, one row at a time.
* ``test_refused_flags_say_so``: the torchrun flags ckptless does not implement are refused
  at start with one line naming the flag.
"""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from ckptless.coordinator.embedded import EmbeddedEtcd, free_port
from ckptless.errors import ConfigError
from ckptless.launcher.args import build_parser, parse_args

from ..harness.cluster import TRAIN, Cluster, FaultFree, assert_bitwise_equal, descendants
from ckptless.launcher import worker_env
from ckptless.worker import nccl_env

from ..harness import nccl_like
from ..harness.flag_matrix import (BASE, BITWISE, ENDS, ENV_ROWS, PRINTS, REFUSED, ROWS, FlagRow, env_job, job_args, jobs,
                                   rows_by_flag)
from ..harness.repo import PYTHON
from ..harness.rotation import ci_seed

VICTIM, AT_STEP = 1, 5


def _parser_flags() -> set[str]:
    """Each option of the launcher's parser by its first long spelling (aliases are the same flag)."""
    flags = set()
    for action in build_parser({})._actions:
        longs = [s for s in action.option_strings if s.startswith("--")]
        if longs and longs[0] != "--help":
            flags.add(longs[0])
    return flags


def test_every_flag_has_a_fault_case() -> None:
    have, rows = _parser_flags(), rows_by_flag()
    missing = sorted(have - set(rows))
    assert not missing, f"flags without a row in tests/harness/flag_matrix.py (add each with its fault case): {missing}"
    stale = sorted(set(rows) - have)
    assert not stale, f"rows for flags the parser no longer has: {stale}"
    for row in ROWS:
        assert row.outcome in (BITWISE, ENDS, REFUSED, BASE, PRINTS), row
        assert bool(row.job) == (row.outcome in (BITWISE, ENDS)), f"{row.flag}: a run row needs a job, others none"
        if row.outcome in (BITWISE, ENDS, REFUSED, PRINTS):
            assert row.args, f"{row.flag}: no non-default value to try"


def test_printing_flags_print_and_start_nothing(tmp_path: Path) -> None:
    """As --help: output and exit 0, with no etcd, no rendezvous and no worker (nothing for a fault to meet)."""
    for row in (r for r in ROWS if r.outcome == PRINTS):
        proc = subprocess.run([PYTHON, "-m", "ckptless.launcher.main", *row.args], capture_output=True, text=True,
                              timeout=60, cwd=tmp_path, env=dict(os.environ, CKPTLESS_ETCD_ENDPOINT="127.0.0.1:1"))
        if row.flag == "--print-completion" and importlib.util.find_spec("shtab") is None:
            # torchrun's needs shtab too: without it, one line naming it, exit 1, no traceback.
            assert proc.returncode == 1 and "shtab" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        else:
            assert proc.returncode == 0 and proc.stdout.strip(), (row.flag, proc.returncode, proc.stderr[-2000:])
        assert not list(tmp_path.iterdir()), f"{row.flag} wrote files"


def test_refused_flags_say_so() -> None:
    for row in (r for r in ROWS if r.outcome == REFUSED):
        with pytest.raises(ConfigError, match=row.flag):
            parse_args(["--standalone", *row.args, TRAIN], environ={})


@pytest.fixture(scope="module")
def twin(baseline: FaultFree) -> dict[int, dict[str, object]]:
    """The one fault-free run every row is compared with (no flag changes the training's math)."""
    return baseline.finals


def _fill(args: tuple[str, ...], out: Path, shm: Path | None, port: int) -> list[str]:
    subst = {"{out}": str(out), "{shm}": str(shm), "{port}": str(port), "{train}": TRAIN, "{python}": PYTHON}
    filled = []
    for a in args:
        for k, v in subst.items():
            a = a.replace(k, v)
        filled.append(a)
    return filled


def _run_rows(etcd: EmbeddedEtcd, tmp_path: Path, rows: list[FlagRow], twin: dict[int, dict[str, object]]) -> None:
    out = tmp_path / "job"
    out.mkdir()
    shm = None
    if any("{shm}" in a for r in rows for a in r.args):
        if not os.access("/dev/shm", os.W_OK):
            pytest.skip("/dev/shm is not writable here")
        shm = Path(f"/dev/shm/ckptless-matrix-{uuid.uuid4().hex[:8]}")
        shm.mkdir()
    single = any(r.single_node for r in rows)
    scripts = [r.script for r in rows if r.script]
    assert len(scripts) <= 1, f"one job, one way to run the script: {scripts}"
    script = _fill(scripts[0], out, shm, 0) if scripts else [TRAIN, str(out)]
    args = _fill(job_args(rows), out, shm, free_port())
    outcome = ENDS if any(r.outcome == ENDS for r in rows) else BITWISE
    c = Cluster(etcd.endpoint, out, f"matrix-{uuid.uuid4().hex[:6]}",
                env={"REF_PAUSE_RANK": str(VICTIM), "REF_PAUSE_STEP": str(AT_STEP)})
    try:
        for _ in range(1 if single else 2):
            c.start_agent(*args, nproc=4 if single else 2, script=script[0], script_args=script[1:],
                          single_node=single)
        victim = c.paused_pid(VICTIM)
        os.kill(victim, signal.SIGKILL)
        if outcome == BITWISE:
            c.wait(timeout=180)
        else:
            _ends_at_once(c)
    finally:
        c.kill_all()
        if shm is not None:
            leftovers = sorted(p.name for p in shm.iterdir())
            for p in shm.iterdir():
                p.unlink()
            shm.rmdir()
            assert not leftovers, f"left in the shm dir after the job: {leftovers}"
    if outcome == BITWISE:
        assert_bitwise_equal(c.finals(), twin)
        _row_checks(rows, c)


def _ends_at_once(c: Cluster) -> None:
    """Recovery off: every agent exits non-zero within seconds, naming the lost rank; no process is left."""
    t0 = time.monotonic()
    for a in c.agents:
        code = a.wait(timeout=60)
        assert code != 0, f"agent {a.pid} exited 0 although rank {VICTIM} was killed with recovery off"
    took = time.monotonic() - t0
    assert took < 45, f"the job took {took:.1f}s to end after the kill"
    text = c.log_text()
    assert f"rank {VICTIM}" in text, text[-3000:]
    for a in c.agents:
        assert not descendants(a.pid), f"agent {a.pid} left processes behind"


def _row_checks(rows: list[FlagRow], c: Cluster) -> None:
    """What each flag promises beyond recovering (cheap checks on the finished job)."""
    flags = {r.flag for r in rows}
    text = c.log_text()
    if "--metrics-port" in flags:
        assert "metrics at http://" in text and "metrics: " not in text, text[-3000:]
    if "--goodput-dir" in flags:
        assert any((c.out / "goodput").rglob("*.jsonl")), "no goodput ledger written"
    if "--log-dir" in flags:
        assert any((c.out / "logs").rglob("*")), "no worker logs under --log-dir"
    if "--snapshot-every" in flags:
        assert any((c.out / "snap").iterdir()), "no snapshot written"


# CI's time budget (20 minutes in all) holds CI_JOBS of the shared jobs, ~20 s each; the others are
# marked slow (`make test-all` runs every one). The subset is seeded by the UTC day, so consecutive CI
# runs cover different jobs and every job runs within a few days; CKPTLESS_MATRIX_SEED=N reproduces a
# day's choice (the chosen jobs are the test ids that are not deselected).
CI_JOBS = 2


def _job_params() -> list[Any]:
    names = sorted(jobs())
    chosen = set(random.Random(ci_seed()).sample(names, min(CI_JOBS, len(names))))
    return [pytest.param(n, marks=() if n in chosen else (pytest.mark.slow,)) for n in names]


@pytest.mark.parametrize("job", _job_params())
def test_flag_job_with_a_kill(module_etcd: EmbeddedEtcd, tmp_path: Path, twin: dict[int, dict[str, object]],
                              job: str) -> None:
    _run_rows(module_etcd, tmp_path, jobs()[job], twin)


@pytest.mark.slow  # one job per row: ~12 s each; CI runs the shared jobs above
@pytest.mark.parametrize("flag", [r.flag for r in ROWS if r.outcome in (BITWISE, ENDS)])
def test_each_flag_alone_with_a_kill(module_etcd: EmbeddedEtcd, tmp_path: Path, twin: dict[int, dict[str, object]],
                                     flag: str) -> None:
    _run_rows(module_etcd, tmp_path, [r for r in ROWS if r.flag == flag], twin)


# --- torch's NCCL settings (ckptless/worker/nccl_env.py) set by the user, beside a fault ---------------------


def test_every_nccl_setting_has_a_fault_case() -> None:
    """A setting ckptless gives torch cannot land without a row: the value a user may set instead, and what
    it does with a kill (or that it is refused at start)."""
    covered = {r.var for r in ENV_ROWS}
    wanted = {s.name for s in nccl_env.SETTINGS} | {"TORCH_NCCL_NONBLOCKING_TIMEOUT"}
    assert wanted <= covered, f"torch NCCL settings without a matrix row: {sorted(wanted - covered)}"


def test_every_accepted_nccl_setting_is_accepted_alone() -> None:
    for row in (r for r in ENV_ROWS if r.outcome == BITWISE):
        nccl_env.check({row.var: row.value, **dict(row.also)})


@pytest.mark.parametrize("row", [r for r in ENV_ROWS if r.outcome == REFUSED], ids=lambda r: f"{r.var}={r.value}")
def test_a_refused_nccl_setting_stops_the_launch_naming_it(row: Any) -> None:
    env = {row.var: row.value, **dict(row.also)}
    with pytest.raises(ConfigError, match=row.var):
        worker_env.nccl_settings(env)


@pytest.mark.rotating(2)  # CI budget: tests/harness/rotation.py
def test_user_nccl_settings_with_a_kill(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                        twin: dict[int, dict[str, object]]) -> None:
    """Every accepted row's value at once, on the NCCL-semantics backend, rank 1 SIGKILLed at step 5: bitwise,
    and the user's values reached the workers (the launcher keeps them)."""
    user = env_job()
    out = tmp_path / "job"
    out.mkdir()
    c = Cluster(module_etcd.endpoint, out, f"matrix-env-{uuid.uuid4().hex[:6]}",
                env={"REF_PAUSE_RANK": str(VICTIM), "REF_PAUSE_STEP": str(AT_STEP), **nccl_like.job_env(
                    user["TORCH_NCCL_ASYNC_ERROR_HANDLING"]), **user})
    try:
        c.start_agent()
        c.start_agent()
        os.kill(c.paused_pid(VICTIM), signal.SIGKILL)
        c.wait(timeout=180)
    finally:
        c.kill_all()
    assert_bitwise_equal(c.finals(), twin)
    text = c.log_text()
    assert "tearing the process down" not in text and "Terminating the process" not in text
    assert "TORCH_NCCL_ENABLE_MONITORING=1" in text, "the allowed-with-a-warning value was not warned about"
