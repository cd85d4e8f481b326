"""Warm respawns through the fork server, with real processes and signals.

Every warm incarnation is compared with a cold one of the same command (what
``python -u ...`` gives): argv, env, cwd, sys.path, __main__'s globals, open
fds, signal dispositions, process group, exit status, traceback text.
Synchronisation is on FIFOs, pidfds, the server's ready message and thread
joins: no sleeps.  Each group pays one ``import torch`` in its server.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ckptless.launcher import forkserver
from ckptless.launcher.args import Std
from ckptless.launcher.forkserver import WarmPlan, main_path0, plan, startup_mismatch
from ckptless.launcher.worker_env import RUN_PATH_CODE
from ckptless.launcher.worker_logs import WorkerLogs, make_log_layout, make_run_log_dir
from ckptless.launcher.workers import WorkerGroup
from ckptless.worker import spare_site

from ..harness.processes import Fifo, Recorder, alive, wait_dead

PY = sys.executable
TIMEOUT = 30.0
READY = 120.0  # one import torch in the server, on a loaded 2-core box

PROBE = r'''
G0 = {k: (type(v).__name__, getattr(v, "path", None), getattr(v, "name", None))
      if k == "__loader__" else repr(v) for k, v in globals().items()}
import os, sys, time
T0 = time.monotonic()
TASKS = len(os.listdir("/proc/self/task"))
MODS = {m: m in sys.modules for m in ("torch", "helper", "preloaded_mod", "torch._dynamo")}
import gc
FROZEN = gc.get_freeze_count()
import json, signal, threading, faulthandler


def say(obj):
    fd = os.open(os.environ["PROBE_FIFO"], os.O_WRONLY)
    os.write(fd, (json.dumps(obj) + "\n").encode())
    os.close(fd)


def fds():
    out = {}
    for f in os.listdir("/proc/self/fd"):
        try:
            out[f] = os.readlink(f"/proc/self/fd/{f}")
        except OSError:
            pass
    return out


mode = os.environ.get("PROBE_MODE", "exit")
if mode == "facts":
    import helper
    say({"t0": T0, "pid": os.getpid(), "ppid": os.getppid(), "pgid": os.getpgid(0), "sid": os.getsid(0),
         "tasks": TASKS, "mods": MODS, "frozen": FROZEN, "helper": helper.WHO, "argv": sys.argv, "orig_argv": sys.orig_argv,
         "cwd": os.getcwd(), "env": dict(os.environ), "path": sys.path, "globals": G0, "fds": fds(),
         "signals": {int(s): repr(signal.getsignal(s)) for s in signal.valid_signals()},
         "mask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
         "faulthandler": faulthandler.is_enabled(), "threads": threading.active_count(),
         "main_thread": threading.current_thread() is threading.main_thread(), "flags": list(sys.flags),
         "umask": os.umask(0o22), "stdout": [sys.stdout.write_through, sys.stdout.encoding, sys.stderr.errors],
         "name": __name__})
elif mode == "rng":
    import random
    import numpy
    import torch
    seed = torch.initial_seed()
    say({"tasks": TASKS, "seed": seed, "first": torch.rand(1).item(),
         "expected": torch.rand(1, generator=torch.Generator().manual_seed(seed)).item(),
         "random": random.random(), "numpy": float(numpy.random.random()), "hash": hash("ckptless"),
         "torch_loaded": MODS["torch"]})
elif mode == "raise":
    def inner():
        raise ValueError("boom")
    inner()
elif mode == "sysexit_msg":
    sys.exit("bad thing")
elif mode == "kbint":
    raise KeyboardInterrupt
elif mode == "sleep":
    say({"pid": os.getpid(), "pgid": os.getpgid(0), "torch": MODS["torch"]})
    time.sleep(600)
elif mode == "grandchild":
    import subprocess
    gc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    say({"gc": gc.pid})
    sys.exit(3)
elif mode == "print":
    print("out", os.environ["PROBE_TAG"], flush=True)
    print("err", os.environ["PROBE_TAG"], file=sys.stderr, flush=True)
sys.exit(int(os.environ.get("PROBE_CODE", "0")))
'''


@pytest.fixture(scope="module", autouse=True)
def _stop_adopting() -> Iterator[None]:
    """Warm groups make the pytest process a child subreaper; undo it for the other test modules."""
    yield
    forkserver.set_child_subreaper(False)


@pytest.fixture
def probe_dir(tmp_path: Path) -> Path:
    d = tmp_path / "code"
    d.mkdir()
    (d / "probe.py").write_text(PROBE)
    (d / "helper.py").write_text("import os\nWHO = os.getpid()\n")
    (d / "preloaded_mod.py").write_text(
        "import os\nwith open(os.environ['PROBE_MARK'], 'a') as f:\n    f.write(f'{os.getpid()}\\n')\n")
    return d


def make_group(tmp_path: Path, fifo: Fifo, tail: list[str], env: dict[str, str] | None = None,
               rec: Recorder | None = None, cwd: Path | None = None, **kw: Any) -> WorkerGroup:
    full = {**os.environ, "PROBE_FIFO": fifo.path, "PROBE_MODE": "exit", "PROBE_MARK": str(tmp_path / "mark"),
            **(env or {})}
    wd = cwd or tmp_path / "wd"
    wd.mkdir(exist_ok=True)
    return WorkerGroup([[PY, "-u", *tail]], [full], rec, cwd=str(wd), warm=True, **kw)


def started(g: WorkerGroup) -> WorkerGroup:
    """Start (cold), let incarnation 0 end, wait for the server."""
    g.start()
    assert g.wait(TIMEOUT) is not None
    assert g.warm_ready(READY), "fork server never became ready"
    return g


def respawn_warm(g: WorkerGroup, **env: str) -> int:
    pid = g.respawn(0, env)
    assert g.spawned_warm(0)
    return pid


def comparable(facts: dict[str, Any]) -> dict[str, Any]:
    """Facts that must be equal; object addresses in reprs differ between any two processes."""
    out = {k: v for k, v in facts.items() if k not in ("t0", "pid", "ppid", "pgid", "sid", "mods", "env", "helper",
                                                         "frozen")}
    out["globals"] = {k: re.sub(r" at 0x[0-9a-f]+", "", v) if isinstance(v, str) else v
                      for k, v in facts["globals"].items()}
    out["globals_order"] = list(facts["globals"])
    return out


@pytest.mark.parametrize("kind", ["script", "module", "run_path"])
def test_warm_worker_is_like_a_fresh_python(tmp_path: Path, fifo: Fifo, probe_dir: Path, kind: str) -> None:
    tail = {"script": ["../code/probe.py", "a b", "lr=${local_rank}"],
            "module": ["-m", "probe", "a b"],
            "run_path": ["-c", RUN_PATH_CODE, str(probe_dir / "probe.py"), "x"]}[kind]
    env = {"PROBE_MODE": "facts", "PROBE_CODE": "4", "PYTHONPATH": str(probe_dir)}
    rec = Recorder()
    g = started(make_group(tmp_path, fifo, tail, env, rec))
    try:
        cold = json.loads(fifo.line())
        warm_pid = respawn_warm(g, PROBE_GEN="2")
        warm = json.loads(fifo.line())
        exits = [e for e, _ in rec.wait_for(2)]
    finally:
        g.stop(5.0)
    assert [(e.incarnation, e.exitcode) for e in exits] == [(0, 4), (1, 4)]
    assert warm["pid"] == warm_pid == warm["pgid"] == warm["sid"] and warm["ppid"] == os.getpid()
    assert cold["pid"] == cold["pgid"] == cold["sid"] and cold["ppid"] == os.getpid()
    assert warm["env"] == dict(cold["env"], PROBE_GEN="2")
    assert cold["mods"] == {"torch": False, "helper": False, "preloaded_mod": False, "torch._dynamo": False}
    # torch._dynamo by default (issue 35: a first optimizer imports it, 0.4-1 s of the respawn's setup)
    assert warm["mods"] == {"torch": True, "helper": False, "preloaded_mod": False, "torch._dynamo": True}
    assert warm["helper"] == warm["pid"], "the script's own module must be imported in the worker"
    # the preloads' objects are frozen out of the cyclic GC in the server (a worker's collections skip them)
    assert cold["frozen"] == 0 and warm["frozen"] > 10_000
    assert warm["tasks"] == cold["tasks"] == 1
    assert comparable(warm) == comparable(cold)


def test_exit_statuses_and_tracebacks_match_cold(tmp_path: Path, fifo: Fifo, probe_dir: Path) -> None:
    err = tmp_path / "stderr.log"
    rec = Recorder()
    g = started(make_group(tmp_path, fifo, [str(probe_dir / "probe.py")], rec=rec,
                           logs=[WorkerLogs(stderr=str(err))]))
    cases = {"exit": (0, ""), "raise": (1, "ValueError: boom"), "sysexit_msg": (1, "bad thing"),
             "kbint": (-2, "KeyboardInterrupt"), "exitcode": (3, "")}
    try:
        for n, (mode, (rc, tail)) in enumerate(cases.items(), start=2):
            env = dict(os.environ, PROBE_MODE=mode, PROBE_CODE="3" if mode == "exitcode" else "0",
                       PROBE_FIFO=fifo.path)
            cold = subprocess.run([PY, "-u", str(probe_dir / "probe.py")], env=env, cwd=tmp_path / "wd",
                                  capture_output=True, text=True, timeout=TIMEOUT, check=False)
            size = err.stat().st_size
            respawn_warm(g, PROBE_MODE=mode, PROBE_CODE=env["PROBE_CODE"])
            ex = rec.wait_for(n)[-1][0]
            warm_err = err.read_bytes()[size:].decode()
            assert (ex.returncode, cold.returncode) == (rc, rc), mode
            assert warm_err == cold.stderr and tail in warm_err, mode
            assert "forkserver" not in warm_err
    finally:
        g.stop(5.0)


def test_syntax_error_reported_like_python(tmp_path: Path, fifo: Fifo) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("x = 1\ndef (:\n")
    err = tmp_path / "stderr.log"
    rec = Recorder()
    g = started(make_group(tmp_path, fifo, [str(bad)], rec=rec, logs=[WorkerLogs(stderr=str(err))]))
    try:
        cold_err = err.read_text()
        respawn_warm(g)
        ex = rec.wait_for(2)[-1][0]
    finally:
        g.stop(5.0)
    assert ex.exitcode == 1 and "SyntaxError" in cold_err
    assert err.read_text() == cold_err * 2


def test_sigkill_of_warm_worker_reported(tmp_path: Path, fifo: Fifo, probe_dir: Path) -> None:
    rec = Recorder()
    g = started(make_group(tmp_path, fifo, [str(probe_dir / "probe.py")], rec=rec))
    try:
        latencies = []
        for n in range(2, 5):
            pid = respawn_warm(g, PROBE_MODE="sleep")
            said = json.loads(fifo.line())
            assert said == {"pid": pid, "pgid": pid, "torch": True} and g.pids() == {0: pid}
            t0 = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            ex, called = rec.wait_for(n)[-1]
            assert (ex.pid, ex.signal, ex.returncode, ex.incarnation) == (pid, 9, -9, n - 1)
            latencies.append(called - t0)
        print(f"\nwarm worker: exit report {max(latencies) * 1e3:.1f} ms max after SIGKILL")
        assert max(latencies) < 1.0
    finally:
        g.stop(5.0)


def test_stop_and_send_signal_reach_warm_worker(tmp_path: Path, fifo: Fifo, probe_dir: Path) -> None:
    rec = Recorder()
    g = started(make_group(tmp_path, fifo, [str(probe_dir / "probe.py")], rec=rec))
    server = g.forkserver_pid()
    assert server is not None
    pid = respawn_warm(g, PROBE_MODE="sleep")
    fifo.line()
    assert g.send_signal(0, signal.SIGTERM)
    assert rec.wait_for(2)[-1][0].signal == signal.SIGTERM
    respawn_warm(g, PROBE_MODE="sleep")
    fifo.line()
    exits = g.stop(5.0)
    assert exits[0].signal == signal.SIGTERM and exits[0].requested
    assert wait_dead(server, 5.0) and not alive(pid)


def test_worker_grandchildren_killed_and_reaped(tmp_path: Path, fifo: Fifo, probe_dir: Path) -> None:
    """We adopt a dead warm worker's descendants (subreaper): they are killed and reaped, not zombies."""
    rec = Recorder()
    g = started(make_group(tmp_path, fifo, [str(probe_dir / "probe.py")], rec=rec))
    try:
        respawn_warm(g, PROBE_MODE="grandchild")
        gc = json.loads(fifo.line())["gc"]
        assert rec.wait_for(2)[-1][0].exitcode == 3
        assert wait_dead(gc, 5.0), "grandchild orphaned"
        for t in threading.enumerate():
            if t.name == "ckptless-reaper-0":
                t.join(TIMEOUT)  # the reaper reaps the adopted orphans after reporting
        assert not os.path.exists(f"/proc/{gc}"), "adopted grandchild left as a zombie"
    finally:
        g.stop(5.0)


AGENT = """
import json, os, sys, time
from ckptless.launcher.workers import WorkerGroup
env = dict(os.environ, PROBE_MODE="exit")
g = WorkerGroup([[sys.executable, "-u", sys.argv[1]]], [env], warm=True)
g.start()
assert g.wait(30) is not None and g.warm_ready(120)
pid = g.respawn(0, {"PROBE_MODE": "sleep"})
print(json.dumps({"worker": pid, "server": g.forkserver_pid(), "warm": g.spawned_warm(0)}), flush=True)
time.sleep(600)
"""


def test_agent_sigkill_kills_warm_worker_and_server(tmp_path: Path, fifo: Fifo, probe_dir: Path) -> None:
    env = dict(os.environ, PROBE_FIFO=fifo.path)
    proc = subprocess.Popen([PY, "-c", AGENT, str(probe_dir / "probe.py")], stdout=subprocess.PIPE, text=True,
                            env=env)
    try:
        assert proc.stdout is not None
        said = json.loads(fifo.line(READY))  # the warm worker runs user code
        info = json.loads(proc.stdout.readline())
        assert info["warm"] and said["pid"] == info["worker"] and said["torch"]
        assert alive(info["worker"]) and alive(info["server"])
        proc.kill()
        proc.wait(TIMEOUT)
        assert wait_dead(info["worker"], 5.0), "warm worker outlived its SIGKILLed agent"
        assert wait_dead(info["server"], 5.0), "fork server outlived its SIGKILLed agent"
        for pid in (info["worker"], info["server"]):  # adopted by pytest if earlier tests made it a subreaper
            forkserver.reap_group_orphans(pid)
    finally:
        proc.kill()
        proc.wait(TIMEOUT)


def test_dead_server_cold_fallback_then_restart(tmp_path: Path, fifo: Fifo, probe_dir: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    rec = Recorder()
    g = started(make_group(tmp_path, fifo, [str(probe_dir / "probe.py")], rec=rec))
    try:
        first = g.forkserver_pid()
        assert first is not None
        os.kill(first, signal.SIGKILL)
        assert wait_dead(first, 5.0)
        g.respawn(0, {"PROBE_MODE": "sleep"})
        assert not g.spawned_warm(0) and json.loads(fifo.line())["torch"] is False
        assert "cold respawn" in caplog.text and "starting a new one" in caplog.text
        g.send_signal(0, signal.SIGKILL)
        rec.wait_for(2)
        assert g.warm_ready(READY)
        second = g.forkserver_pid()
        assert second is not None and second != first
        respawn_warm(g, PROBE_MODE="sleep")
        assert json.loads(fifo.line())["torch"] is True
    finally:
        g.stop(5.0)


def test_redirect_and_tee_of_warm_worker(tmp_path: Path, fifo: Fifo, probe_dir: Path,
                                         capfd: pytest.CaptureFixture[str]) -> None:
    logs = make_log_layout(make_run_log_dir(str(tmp_path / "logs"), "job"), 0, [Std.ALL], [Std.OUT])
    rec = Recorder()
    g = started(make_group(tmp_path, fifo, [str(probe_dir / "probe.py")], {"PROBE_MODE": "print", "PROBE_TAG": "c"},
                           rec=rec, logs=logs))
    try:
        respawn_warm(g, PROBE_TAG="w")
        rec.wait_for(2)
    finally:
        g.stop(5.0)
    assert logs[0].stdout and logs[0].stderr
    assert Path(logs[0].stdout).read_text() == "out c\nout w\n"
    assert Path(logs[0].stderr).read_text() == "err c\nerr w\n"
    out, err = capfd.readouterr()
    assert "[default0]:out c\n[default0]:out w\n" in out and "err w" not in err  # --tee prefixes like torchrun


def test_rng_and_hash_seed_like_fresh_processes(tmp_path: Path, fifo: Fifo, probe_dir: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    """torch/random/numpy seeds are fresh per worker (as in new processes); PYTHONHASHSEED is honoured."""
    caplog.set_level(logging.WARNING)
    g = make_group(tmp_path, fifo, [str(probe_dir / "probe.py")], {"PROBE_MODE": "rng", "PYTHONHASHSEED": "0"})
    g.start()
    try:
        cold = json.loads(fifo.line(READY))
        assert g.wait(TIMEOUT) is not None and g.warm_ready(READY)
        warm = []
        for _ in range(2):
            respawn_warm(g)
            warm.append(json.loads(fifo.line()))
            assert g.wait(TIMEOUT) is not None
        g.respawn(0, {"PYTHONHASHSEED": "1"})
        assert not g.spawned_warm(0) and "PYTHONHASHSEED" in caplog.text
        assert g.wait(TIMEOUT) is not None
        fifo.line(READY)
    finally:
        g.stop(5.0)
    runs = [cold, *warm]
    assert [r["torch_loaded"] for r in runs] == [False, True, True]
    for key in ("seed", "random", "numpy"):
        assert len({r[key] for r in runs}) == 3, key
    assert all(r["first"] == r["expected"] for r in runs), "torch's generator is not fresh at its seed"
    assert {r["hash"] for r in runs} == {cold["hash"]}


def test_preload_env_imports_in_server_only(tmp_path: Path, fifo: Fifo, probe_dir: Path) -> None:
    env = {"PROBE_MODE": "facts", "CKPTLESS_PRELOAD": "preloaded_mod, json, -torch._dynamo",
           "PYTHONPATH": str(probe_dir)}
    g = started(make_group(tmp_path, fifo, [str(probe_dir / "probe.py")], env))
    try:
        fifo.line()
        respawn_warm(g)
        warm = json.loads(fifo.line())
        server = g.forkserver_pid()
    finally:
        g.stop(5.0)
    # "-torch._dynamo": the default optional preload is left to the script
    assert warm["mods"] == {"torch": True, "helper": False, "preloaded_mod": True, "torch._dynamo": False}
    marks = (tmp_path / "mark").read_text().split()
    assert marks == [str(server)], "a preloaded module is imported once, in the server"


def test_broken_preload_means_cold(tmp_path: Path, fifo: Fifo, probe_dir: Path,
                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    g = make_group(tmp_path, fifo, [str(probe_dir / "probe.py")], {"CKPTLESS_PRELOAD": "no_such_module_x"})
    g.start()
    try:
        assert g.wait(TIMEOUT) is not None
        assert not g.warm_ready(READY)
        g.respawn(0)
        assert not g.spawned_warm(0) and "no_such_module_x" in caplog.text
        assert g.forkserver_pid() is None and "starting a new one" not in caplog.text  # no restart loop
        assert g.wait(TIMEOUT) is not None
    finally:
        g.stop(5.0)


def test_plan_and_startup_rules(tmp_path: Path) -> None:
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    (tmp_path / "z.py").write_bytes(b"PK\x03\x04")
    cwd = str(tmp_path)
    assert plan([PY, "-u", "s.py", "a"], PY, cwd) == WarmPlan("script", "s.py", ("a",))
    assert plan([PY, "-u", "-m", "pkg.mod", "a"], PY, cwd) == WarmPlan("module", "pkg.mod", ("a",))
    assert plan([PY, "-u", "-c", "code", "a"], PY, cwd) == WarmPlan("code", "code", ("a",))
    for argv in ([PY, "s.py"], ["/other/python", "-u", "s.py"], [PY, "-u", "-X", "dev", "s.py"], [PY, "-u", "z.py"],
                 [PY, "-u", "missing.py"], [PY, "-u", "-m"], ["s.py"], [PY, "-u", "s.pyc"]):
        assert isinstance(plan(argv, PY, cwd), str), argv
    assert startup_mismatch({"PYTHONHASHSEED": "0", "RANK": "0"}, {"PYTHONHASHSEED": "0", "RANK": "1"}) is None
    assert "OMP_NUM_THREADS" in str(startup_mismatch({"OMP_NUM_THREADS": "1"}, {}))
    assert "PYTHONPATH" in str(startup_mismatch({}, {"PYTHONPATH": "/x"}))
    assert main_path0(WarmPlan("script", "s.py", ()), cwd) == os.path.realpath(cwd)
    assert main_path0(WarmPlan("module", "m", ()), cwd) == os.path.realpath(cwd)
    assert main_path0(WarmPlan("code", "c", ()), cwd) == ""


SPARE_PROBE = """
import os
rank = os.environ["RANK"]  # before anything of ckptless is imported
import json
from ckptless.worker import rank_reads
fd = os.open(os.environ["PROBE_FIFO"], os.O_WRONLY)
os.write(fd, (json.dumps({"reads": rank_reads.reads(), "from_start": rank_reads.watched_from_start()}) + "\\n").encode())
os.close(fd)
"""


def test_a_spares_first_line_is_watched_cold_and_warm(tmp_path: Path, fifo: Fifo, probe_dir: Path) -> None:
    """Issue 35: a cold start runs ckptless/worker/spare_site's sitecustomize; a warm one is forked from a
    server that ran it with its own environment, and watches from the worker's first line again."""
    (probe_dir / "spare_probe.py").write_text(SPARE_PROBE)
    env = {"PYTHONPATH": spare_site.pythonpath(str(probe_dir)), "CKPTLESS_ROLE": "spare",
           "CKPTLESS_STANDBY_RANK": "0", "RANK": "2"}
    rec = Recorder()
    g = started(make_group(tmp_path, fifo, [str(probe_dir / "spare_probe.py")], env, rec))
    try:
        cold = json.loads(fifo.line())
        respawn_warm(g)
        warm = json.loads(fifo.line())
        rec.wait_for(2)
        respawn_warm(g, CKPTLESS_ROLE="member")  # not a spare: not watched
        again = json.loads(fifo.line())
    finally:
        g.stop(5.0)
    read = f"os.environ['RANK'] at {probe_dir / 'spare_probe.py'}:3"
    assert cold == warm == {"reads": [read], "from_start": True}, (cold, warm)
    assert again == {"reads": [], "from_start": False}
