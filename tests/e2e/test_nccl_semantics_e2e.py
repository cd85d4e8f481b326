"""The backend with NCCL's and torch's failure semantics itself (tests/harness/nccl_like.py), on CPU.

Each test checks one rule of the stand-in against what real NCCL did on one H200
(docs/gpu-runs/2026-11-28-h200/nccl_facts.json), with plain processes and a real TCPStore, so that
the recovery tests that run on it (tests/e2e/test_recovery_e2e.py, test_ddp_fsdp_e2e.py,
test_nccl_machinery_e2e.py) meet what a GPU cluster would do to ckptless, not a friendlier model.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import datetime, os, sys, threading, time
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from tests.harness.nccl_like import NcclLikeGroup
case, rank, port = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
t = datetime.timedelta
def say(*a):  # one write(2): a thread's traceback on stderr (the same pipe) never lands inside the line
    os.write(1, (" ".join(map(str, a)) + "\n").encode())
if case == "monitor":  # a process whose first group forms after the key exists
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=t(seconds=20))
    g = NcclLikeGroup(dist.PrefixStore("late/", store), 0, 1, t(seconds=20), "late")
    g.eager_connect_single_device(None)
    g.allreduce([torch.ones(1)]).wait()
    say("formed")
    time.sleep(4)  # a deadline for the monitor to act: four heartbeat timeouts
    say("lived")
    os._exit(0)
store = dist.TCPStore("127.0.0.1", port, None, rank == 0 and case != "uid_get",
                      timeout=t(seconds=2 if case == "uid_get" else 20))
g = NcclLikeGroup(dist.PrefixStore("pg/", store), rank, 2, t(seconds=20), "t")
if case == "init_lock":  # rank 0 of two; rank 1 never comes
    g.eager_connect_single_device(None)
    out = []
    def check():
        try:
            g.allreduce([torch.ones(1)]).wait()
            out.append("formed")
        except RuntimeError as e:
            out.append("raised " + str(e)[:40])
    th = threading.Thread(target=check, daemon=True); th.start(); th.join(0.5)
    t0 = time.monotonic(); g.abort(); say("abort returned after", round(time.monotonic() - t0, 1))
    th.join(5); say("check", out)
    os._exit(0)
if case == "uid_get":  # rank 1 of two; rank 0 never comes
    th = threading.Thread(target=lambda: g.eager_connect_single_device(None), daemon=True); th.start(); th.join(0.5)
    t0 = time.monotonic(); store.add("other", 1); say("add waited", round(time.monotonic() - t0, 1))
    os._exit(0)
g.eager_connect_single_device(None)
g.allreduce([torch.ones(1)]).wait()  # both alive: completes
if rank == 1:
    os._exit(0)  # the peer dies
time.sleep(0.3)  # its sockets close (a deadline, not a synchronisation: the held work is checked below)
w = g.allreduce([torch.ones(4)])
time.sleep(0.3)
say("held" if not w.is_completed() else "completed early")
if case == "p2p":
    time.sleep(1.5)
    say("still held" if not w.is_completed() else "completed early", "key" if store.check(["exception_dump"]) else "no key")
    g.abort()
say("wait", w.wait(), "key" if store.check(["exception_dump"]) else "no key", "error", g.get_error())
try:
    g.allreduce([torch.ones(1)])
    say("next: no error")
except RuntimeError as e:
    say("next raised:", str(e)[:40])
os._exit(0)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(tmp_path: Path, case: str, ranks: tuple[int, ...], port: int | None = None,
         **env: str) -> list[subprocess.CompletedProcess[str]]:
    script = tmp_path / "rules.py"
    script.write_text(SCRIPT)
    port = port or _free_port()
    full = {**os.environ, "TORCH_NCCL_ENABLE_MONITORING": "0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
            "TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC": "250", "NCCL_LIKE_REPORT_S": "0.5", **env}
    procs = [subprocess.Popen([sys.executable, str(script), str(REPO), case, str(r), str(port)], env=full,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in ranks]
    done = []
    for p in procs:
        out, _ = p.communicate(timeout=60)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out))
    return done


def test_a_dead_peer_is_reported_the_watchdog_writes_the_root_key_and_aborts_in_mode_2(tmp_path: Path) -> None:
    """Rules 1, 2, 3, 6: socket transport, mode 2. The collective is held until the watchdog sees the
    reported error, writes exception_dump at the store's root, sleeps, and aborts the communicator;
    wait() then returns True (no error) and the next collective raises."""
    out = _run(tmp_path, "socket", (0, 1))[0].stdout
    assert "held" in out and "wait True key error ErrorType.REMOTE_ERROR" in out, out
    assert "next raised: NCCL communicator was aborted" in out, out


def test_over_p2p_nothing_is_reported_only_an_abort_ends_the_collective(tmp_path: Path) -> None:
    out = _run(tmp_path, "p2p", (0, 1), NCCL_LIKE_TRANSPORT="p2p")[0].stdout
    assert "still held no key" in out and "wait True no key error ErrorType.SUCCESS" in out, out
    assert "next raised: NCCL communicator was aborted" in out, out


def test_torchruns_mode_tears_the_process_down_after_the_post_error_sleep(tmp_path: Path) -> None:
    r = _run(tmp_path, "socket", (0, 1), TORCH_NCCL_ASYNC_ERROR_HANDLING="1")[0]
    assert "tearing the process down" in r.stdout and r.returncode == -signal.SIGABRT, r.stdout


@pytest.mark.parametrize("env, dies", [({}, True), ({"TORCH_NCCL_ENABLE_MONITORING": "0"}, False),
                                       ({"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}, False)],
                         ids=["torch-defaults", "monitoring-off", "dumping-off"])
def test_a_process_whose_first_group_sees_an_old_dump_key_is_ended_by_the_monitor(
        tmp_path: Path, env: dict[str, str], dies: bool) -> None:
    """Rule 4 (measured: ended 14.2 s after forming, heartbeat 8 s): the key a failure left in the store's
    root ends a later process's first group's monitor, unless monitoring or dumping is off."""
    import datetime

    import torch.distributed as dist

    port = _free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=20),
                           wait_for_workers=False)
    server.set("exception_dump", "3")  # what an earlier generation's watchdog left
    full = {"TORCH_NCCL_ENABLE_MONITORING": "1", "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": "1",
            "TORCH_NCCL_COORD_CHECK_MILSEC": "200", **env}
    r = _run(tmp_path, "monitor", (0,), port=port, **full)[0]
    if dies:
        assert "Terminating the process" in r.stdout and r.returncode == -signal.SIGABRT, r.stdout
        assert "lived" not in r.stdout
    else:
        assert "lived" in r.stdout and r.returncode == 0, r.stdout


def test_an_abort_waits_for_an_init_in_progress_to_time_out(tmp_path: Path) -> None:
    """Rule 5 (measured: 10.0 s of a 12 s NONBLOCKING_TIMEOUT): the member check holds the communicator's
    lock while it waits for the init; abort() waits for it."""
    out = _run(tmp_path, "init_lock", (0,), TORCH_NCCL_NONBLOCKING_TIMEOUT="2")[0].stdout
    waited = float(out.split("abort returned after")[1].split()[0])
    assert 1.0 <= waited <= 3.0 and "raised NCCL timeout" in out, out


def test_a_unique_id_get_holds_the_store_client(tmp_path: Path) -> None:
    """Rule 5 (measured: another thread's add waited 10.0 s of a 12 s client timeout)."""
    import datetime

    import torch.distributed as dist

    port = _free_port()
    _server = dist.TCPStore("127.0.0.1", port, None, True, timeout=datetime.timedelta(seconds=20),
                            wait_for_workers=False)
    out = _run(tmp_path, "uid_get", (1,), port=port)[0].stdout
    # The line is one write(2), but the uid thread's traceback (stderr, the same pipe) may stop mid-line
    # before it (CI: "    add waited 1.5" after a partial traceback line): match the line's content only.
    found = re.search(r"add waited (\d+(?:\.\d+)?)\n", out)
    assert found, out
    waited = float(found.group(1))
    assert 1.0 <= waited <= 3.0, out
