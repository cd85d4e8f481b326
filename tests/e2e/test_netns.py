"""The chaos runner's namespace plumbing (chaos/netns.py): real namespaces, veths, a bridge, nft.

Two nodes and the root namespace: every path connects; a node<->root cut
leaves node<->node alone and the reverse; ``drop`` times out, ``reset`` is
refused at once, from both sides; healing restores the path; teardown and the
stale-cleanup pass leave no namespace or link behind. Needs root (skipped
otherwise) plus ``ip`` and ``nft``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from ckptless.chaos import netns
from ckptless.chaos.netns import NetTopology, probe

# Skipped only without root; as root a missing `ip`/`nft` fails (NetnsError names what to install).
pytestmark = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="network namespaces need root")

PORT = 7341
SERVER = ("import socket,sys\n"
          "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
          "s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(64); print('up', flush=True)\n"
          "while True:\n"
          "    c, _ = s.accept(); c.close()\n")


def _listen(prefix: list[str], host: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([*prefix, sys.executable, "-c", SERVER, host, str(PORT)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    return proc


@pytest.fixture
def topo() -> Iterator[NetTopology]:
    t = NetTopology(f"test-netns-{os.getpid()}-{time.monotonic_ns()}", 2).create()
    servers = [_listen([], t.root_ip)] + [_listen(n.exec_prefix(), n.ip) for n in t.nodes]
    try:
        yield t
    finally:
        for s in servers:
            s.kill()
            s.wait()
        t.close()


def _names() -> str:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return ns + links


def test_paths_cut_and_heal(topo: NetTopology) -> None:
    n0, n1 = topo.nodes
    assert probe(n0.ns, topo.root_ip, PORT) == "ok"
    assert probe(n1.ns, topo.root_ip, PORT) == "ok"
    assert probe(n0.ns, n1.ip, PORT) == "ok" and probe(n1.ns, n0.ip, PORT) == "ok"
    assert probe(None, n0.ip, PORT) == "ok"

    cut = topo.cut_from_root(0, PORT, "drop")  # node 0 <-> etcd only
    assert probe(n0.ns, topo.root_ip, PORT, timeout_s=0.5) == "timeout"
    assert probe(n0.ns, n1.ip, PORT) == "ok" and probe(n1.ns, n0.ip, PORT) == "ok"
    assert probe(n1.ns, topo.root_ip, PORT) == "ok"
    assert "drop" in topo.rules(0)
    cut.heal()
    assert probe(n0.ns, topo.root_ip, PORT) == "ok"
    assert topo.rules(0).strip() == ""

    cut = topo.cut_between(0, 1, "reset")  # node 0 <-> node 1, both still reach etcd
    t0 = time.monotonic()
    assert probe(n0.ns, n1.ip, PORT) == "refused"
    assert probe(n1.ns, n0.ip, PORT) == "refused"  # the RST reaches the other side too
    assert time.monotonic() - t0 < 10
    assert probe(n0.ns, topo.root_ip, PORT) == "ok" and probe(n1.ns, topo.root_ip, PORT) == "ok"
    cut.heal()
    assert probe(n0.ns, n1.ip, PORT) == "ok"

    cut = topo.cut_between(1, 0, "drop", keep_ports=(PORT,))  # workers only: the kept port still connects
    assert probe(n0.ns, n1.ip, PORT) == "ok" and probe(n1.ns, n0.ip, PORT) == "ok"
    cut.heal()


def test_teardown_and_stale_cleanup_leave_nothing() -> None:
    t = NetTopology(f"test-netns-stale-{os.getpid()}-{time.monotonic_ns()}", 2).create()
    assert t.nodes[0].ns in _names() and t.bridge in _names()
    # A crashed owner: its state file names a pid that no longer exists.
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (netns.STATE_DIR / f"{t.tag}.json").write_text(json.dumps({"pid": dead.pid, "nodes": 2}))
    assert any(t.tag in r for r in netns.cleanup_stale())
    names = _names()
    assert t.tag not in names, names
    t.close()  # idempotent after the cleanup
    u = NetTopology(f"test-netns-close-{os.getpid()}-{time.monotonic_ns()}", 1).create()
    assert u.bridge in _names()
    u.close()
    assert u.tag not in _names()
    assert not (netns.STATE_DIR / f"{u.tag}.json").exists()
