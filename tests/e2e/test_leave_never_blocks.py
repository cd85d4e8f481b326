"""Leaving a generation never waits on a broken communicator's teardown (issue 35, finding 0).

A real Gloo group with a collective in flight on a lazily connected pair to a peer that does not answer:
the group's destructor waits for that collective. Held out, the peer was SIGKILLed and Gloo retried the
connect for several times its timeout (pytorch/gloo#520; measured here: 19.5 s for a 4 s timeout); but
whether a refused connect is retried depends on the machine (CI's gave up in 0.3 s, and the test showed
nothing), so here the peer is SIGSTOPped, a hung node: the kernel accepts the connect and Gloo's handshake
waits out the whole timeout, on every machine. Before the reaper, a
survivor's training thread ran that destructor in ``RebindableGroup.release`` (60-70 s seen at W = 32 and in
a node loss at W = 4); now ``release_all`` hands it to a thread of its own and returns at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ckptless.worker import groups
from ckptless.worker.rebindable import RebindableGroup, new_gloo

from ..harness.waiting import wait_until

TIMEOUT_S = 3.0

PEER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from ckptless.worker.rebindable import new_gloo
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False, timeout=timedelta(seconds=20))
pg = new_gloo(store, 1, 2, timedelta(seconds=1), lazy=True)
open(sys.argv[2], "w").write("ready")
time.sleep(600)  # SIGSTOPped, then SIGKILLed by the test
"""


def test_release_all_returns_while_a_dead_peers_connect_holds_the_destructor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    master = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=20), wait_for_workers=False)
    ready = tmp_path / "ready"
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(master.port), str(ready)],
                            env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2])))
    try:
        mine = new_gloo(master, 0, 2, timedelta(seconds=TIMEOUT_S), lazy=True)
        wait_until(ready.exists, 60, "the peer's group")
        peer.send_signal(signal.SIGSTOP)
        g = RebindableGroup(0, 2, [0, 1], timedelta(seconds=TIMEOUT_S))
        g._set_group_name("leave-test")
        g.install(1, mine, [mine])
        del mine
        g.allreduce([torch.zeros(4)])  # its pair to the stopped peer connects now and waits for the handshake
        monkeypatch.setattr(groups, "groups", lambda: [g])
        start = time.monotonic()
        rel = groups.release_all(1)
        returned_s = time.monotonic() - start
        assert rel.thread is not None
        rel.thread.join(TIMEOUT_S * 30)
    finally:
        peer.send_signal(signal.SIGKILL)
        peer.wait(30)
    print(f"release_all returned in {returned_s:.3f} s; the destructor took {rel.seconds:.2f} s on the reaper")
    assert returned_s < 0.5, f"release_all took {returned_s:.2f} s: it waited for the destructor"
    assert rel.seconds is not None and rel.seconds > 1.0, "the destructor did not wait: nothing was shown"


@pytest.mark.slow  # minutes: bench/scale.py's W = 4 and W = 32 jobs, several times (issue 35's rate check)
def test_at_w32_no_survivor_waits_to_leave_and_recovery_stays_within_2x_of_w4(tmp_path: Path) -> None:
    """Issue 35, finding 0: held out at 2 agents x 16 ranks, 2 of 3 runs had a survivor ~60 s in the old
    group's teardown (kill -> resumed ~75 s against 2.36 s). Here each run's longest leave must stay under
    2 s and every W = 32 recovery within 2x the slowest W = 4 one. ``CKPTLESS_SCALE_REPEAT`` runs (default 3)."""
    import json

    from ..harness.repo import PYTHON, REPO

    repeat = int(os.environ.get("CKPTLESS_SCALE_REPEAT", "3"))
    out = tmp_path / "scale.json"
    proc = subprocess.run([PYTHON, str(REPO / "bench" / "scale.py"), "--worlds", "4", "32", "--repeat", str(repeat),
                           "--json", str(out)], capture_output=True, text=True, timeout=600 * repeat)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("|")))
    failed = [r for r in rows if "failed" in r]
    assert not failed, failed
    assert all(r["left_s"] < 2.0 for r in rows), [(r["world"], r["left_s"]) for r in rows]
    w4 = max(r["resumed_s"] for r in rows if r["world"] == 4)
    assert all(r["resumed_s"] <= 2 * w4 for r in rows if r["world"] == 32), [(r["world"], r["resumed_s"]) for r in rows]
