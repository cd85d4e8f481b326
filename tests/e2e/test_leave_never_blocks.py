"""Leaving a generation never waits on a broken communicator's teardown (issue 35, finding 0).

A real Gloo group whose peer process was SIGKILLed, with a collective in flight on a lazily connected
pair to it: Gloo retries the connect until several times its timeout (pytorch/gloo#520; measured here:
19.5 s for a 4 s timeout), and the group's destructor waits for that collective. Before the reaper, a
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

TIMEOUT_S = 1.0

PEER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
from ckptless.worker.rebindable import new_gloo
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, False, timeout=timedelta(seconds=20))
pg = new_gloo(store, 1, 2, timedelta(seconds=1), lazy=True)
open(sys.argv[2], "w").write("ready")
time.sleep(600)  # SIGKILLed by the test
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
    finally:
        peer.send_signal(signal.SIGKILL)
        peer.wait(30)
    g = RebindableGroup(0, 2, [0, 1], timedelta(seconds=TIMEOUT_S))
    g._set_group_name("leave-test")
    g.install(1, mine, [mine])
    del mine
    g.allreduce([torch.zeros(4)])  # its pair to the dead peer connects now, retrying past the timeout
    monkeypatch.setattr(groups, "groups", lambda: [g])
    start = time.monotonic()
    rel = groups.release_all(1)
    returned_s = time.monotonic() - start
    assert rel.thread is not None
    rel.thread.join(TIMEOUT_S * 30)
    print(f"release_all returned in {returned_s:.3f} s; the destructor took {rel.seconds:.2f} s on the reaper")
    assert returned_s < 0.5, f"release_all took {returned_s:.2f} s: it waited for the destructor"
    assert rel.seconds is not None and rel.seconds > TIMEOUT_S, "the destructor did not wait: nothing was shown"
