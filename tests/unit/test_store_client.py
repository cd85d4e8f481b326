"""The hedged store connect (ckptless/worker/store_client.py), against a real TCPStore.

A connect that stalls is made by a real TCP relay in front of the store that
holds its first connection silent for a while (bytes neither way), which is
what issue 35's 5 s connect looked like from the client: the same store
answered a fresh connection at once.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from ckptless.errors import TransportError
from ckptless.worker import store_client


class StallingRelay:
    """Forwards TCP connections to ``port``; the first one is held ``stall_s`` before any byte moves."""

    def __init__(self, port: int, stall_s: float) -> None:
        self.port, self.stall_s = port, stall_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[1]
        self.accepted = 0
        self.closed = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            delay = self.stall_s if self.accepted == 1 else 0.0
            threading.Thread(target=self._relay, args=(client, delay), daemon=True).start()

    def _relay(self, client: socket.socket, delay: float) -> None:
        if self.closed.wait(delay):
            client.close()
            return
        upstream = socket.create_connection(("127.0.0.1", self.port))

        def pump(a: socket.socket, b: socket.socket) -> None:
            try:
                while data := a.recv(65536):
                    b.sendall(data)
            except OSError:
                pass
            finally:
                for s in (a, b):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        threading.Thread(target=pump, args=(client, upstream), daemon=True).start()
        pump(upstream, client)

    def close(self) -> None:
        self.closed.set()
        self.listener.close()


@pytest.fixture()
def server() -> Iterator[dist.TCPStore]:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    yield store


def test_a_connect_is_one_attempt(server: dist.TCPStore, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    client = store_client.connect("127.0.0.1", server.port, 30.0)
    client.set("k", b"v")
    assert server.get("k") == b"v"
    assert not caplog.records


def test_a_stalled_connect_is_hedged(server: dist.TCPStore, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    relay = StallingRelay(server.port, stall_s=3.0)
    try:
        t0 = time.monotonic()
        client = store_client.connect("127.0.0.1", relay.address, 30.0, hedge_after_s=0.2)
        took = time.monotonic() - t0
        client.set("hedged", b"yes")
        assert server.get("hedged") == b"yes"
        # without the hedge the connect waits out the stall (3 s); with it, one hedge interval and a connect
        assert took < 2.0, took
        assert relay.accepted >= 2  # the stalled one, the hedge (and the slow connect's bare probe)
        assert any("attempt 2 connected" in r.getMessage() for r in caplog.records)
        deadline = time.monotonic() + 30
        while not any("first connect attempt connected after" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
            time.sleep(0.05)
    finally:
        relay.close()


def test_an_unreachable_store_is_one_clear_error() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(TransportError, match=f"cannot reach the agent's store at 127.0.0.1:{port}"):
        store_client.connect("127.0.0.1", port, 0.5, hedge_after_s=0.2)
    assert time.monotonic() - t0 < 30
