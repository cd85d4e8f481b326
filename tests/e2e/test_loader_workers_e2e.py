"""DataLoader worker processes must not hold a rank's connections: recovery with ``num_workers > 0``
is as fast as without (issue 17: 91 s instead of 4 s, the collective timeout).

The loader workers are forked after the groups formed, so they inherit every
socket of the rank's communicators. A survivor that leaves the failed
generation must still end its connections for the ranks behind it.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

import pytest

from ckptless.coordinator.embedded import EmbeddedEtcd
from ckptless.worker import sockets

from ..harness.cluster import Cluster, FaultFree, assert_bitwise_equal, new_cluster
from ..harness.fds import fd_open

COLLECTIVE_TIMEOUT_S = 60  # a hop that waits it out shows as a job that takes over a minute


def _cluster(etcd: EmbeddedEtcd, tmp_path: Path, name: str, **env: str) -> Cluster:
    return new_cluster(etcd.endpoint, tmp_path, name,
                       **{"CKPTLESS_COLLECTIVE_TIMEOUT": str(COLLECTIVE_TIMEOUT_S), **env})


# CI budget: one victim in CI (rank 3, on the second node); rank 1 in the slow tier.
@pytest.mark.parametrize("victim", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_kill_with_loader_workers_recovers_without_waiting_out_a_timeout(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                                                        baseline: FaultFree, victim: int) -> None:
    # The session's fault-free run (no loader workers): worker processes fetch the same batches in
    # the same order (ResumableLoader), so a recovered run with them must equal it bitwise too.
    base = baseline.finals
    c = _cluster(module_etcd, tmp_path, "kill", REF_LOADER_WORKERS="2", REF_PAUSE_RANK=str(victim),
                 REF_PAUSE_STEP="5")
    try:
        c.start_agent()
        c.start_agent()
        pid = c.paused_pid(victim)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        c.wait(timeout=4 * COLLECTIVE_TIMEOUT_S)
        took = time.monotonic() - t0
    finally:
        c.kill_all()
    assert_bitwise_equal(c.finals(), base)
    text = c.log_text()
    assert "Timed out waiting" not in text, "a survivor waited out the collective timeout:\n" + c.tail()
    # Five steps of a tiny model after the kill; a survivor stuck behind a loader worker's copy of
    # its peer's socket would add the whole collective timeout.
    assert took < COLLECTIVE_TIMEOUT_S / 2, f"kill -> job done took {took:.1f}s\n{c.tail()}"


def test_shutdown_ends_a_connection_a_forked_child_holds() -> None:
    """shutdown(2) reaches the peer although a child keeps a copy; close() alone would not."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    with sockets.recording(10_001):
        ours = socket.create_connection(("127.0.0.1", port))
        peer, _ = listener.accept()
        gloo_like = socket.create_server(("127.0.0.1", 0))  # a listener made in the window (Gloo's)
    assert ours.fileno() in sockets.recorded(10_001) or peer.fileno() in sockets.recorded(10_001)
    to_parent_r, to_parent_w = os.pipe()
    to_child_r, to_child_w = os.pipe()
    child = os.fork()
    if child == 0:  # the child: the fork hook closed its copies of the recorded sockets
        ok = all(not fd_open(fd) for fd in (ours.fileno(), peer.fileno()))
        os.write(to_parent_w, b"1" if ok else b"0")
        os.read(to_child_r, 1)  # stay alive (holding whatever it still holds) until the parent is done
        os._exit(0)
    try:
        assert os.read(to_parent_r, 1) == b"1", "the forked child kept a recorded socket open"
        peer.settimeout(5)
        assert sockets.shutdown(10_001) >= 1
        assert peer.recv(1) == b"", "the peer did not see the connection end"
        # A listener is never shut down (Gloo's event loop aborts the process when its accept fails).
        with socket.create_connection(gloo_like.getsockname()):
            gloo_like.settimeout(5)
            gloo_like.accept()[0].close()
    finally:
        os.write(to_child_w, b"x")
        os.waitpid(child, 0)
        for s in (ours, peer, listener, gloo_like):
            s.close()
        for fd in (to_parent_r, to_parent_w, to_child_r, to_child_w):
            os.close(fd)
    assert sockets.recorded(10_001) == {}
