"""Warm respawn: one fork server per agent with torch already imported.

Why: a respawn otherwise pays Python start-up plus ``import torch`` (2.1-2.4 s
here) on the recovery's critical path.  The server imports torch,
torch.distributed and ``$CKPTLESS_PRELOAD`` once, never runs the training
script, and forks workers on request.

Parenting: the agent is a *child subreaper*; the server forks an intermediate
that forks the worker and exits, so the kernel re-parents the worker to the
agent.  The worker is then the agent's own child (waitid, killpg, reaping as
for a cold worker) and its PDEATHSIG, set only after the re-parenting (which
would fire it), follows the agent, never the server.  User code starts only
after the agent's "go" byte, sent once a reaper watches the pid (EOF: exit).
Full rationale and limits: docs/launcher.md, "Warm respawn".

This module is the agent's side: which commands can be served warm
(:func:`plan`), starting, watching and asking the server (:class:`ForkServer`),
and the forked worker's handle (:class:`WarmChild`). The server's own program,
run by path in its own process, is launcher/forkserver_program.py.
"""

from __future__ import annotations

import array
import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ckptless.launcher import forkserver_program
from ckptless.launcher.forkserver_program import MAX_MSG

PRELOAD_ENV = "CKPTLESS_PRELOAD"
# Read once at interpreter / library load (hash seed, sys.path, stdio encoding,
# libgomp/OpenBLAS/MKL thread settings, loader): a worker whose env differs from
# the server's here would not behave like a fresh process, so it is spawned cold.
STARTUP_ENV_PREFIXES = ("PYTHON", "LD_", "LC_", "LANG", "TORCH_", "OMP_", "GOMP_", "KMP_", "MKL_",
                        "OPENBLAS_", "MALLOC_", "HOME", PRELOAD_ENV)
_PR_SET_CHILD_SUBREAPER = 36
log = logging.getLogger("ckptless.launcher.forkserver")


class ForkServerError(RuntimeError):
    """A warm spawn is impossible right now; the caller spawns cold instead."""


@dataclass(frozen=True)
class WarmPlan:
    """What ``python -u <...>`` runs: a script path, a module (-m) or code (-c)."""

    kind: str  # "script" | "module" | "code"
    target: str
    args: tuple[str, ...]


def plan(argv: Sequence[str], python: str, cwd: str) -> WarmPlan | str:
    """The WarmPlan for argv, or the reason it must run cold.

    Served warm: what ``build_command`` makes, with the server's interpreter
    string and exactly its options (``-u``): ``python -u script|-m mod|-c code``.
    """
    if len(argv) < 3 or argv[0] != python or argv[1] != "-u":
        return f"command is not '{python} -u ...'"
    head, rest = argv[2], tuple(argv[3:])
    if head in ("-m", "-c"):
        if not rest:
            return f"{head} without an argument"
        return WarmPlan("module" if head == "-m" else "code", rest[0], rest[1:])
    if head.startswith("-"):
        return f"interpreter option {head!r} is not served warm"
    if head.endswith((".pyc", ".pyo")):
        return f"{head!r} is byte code"
    path = os.path.join(cwd, head)
    try:
        with open(path, "rb") as f:
            if f.read(2) == b"PK":
                return f"{head!r} is a zip archive"
    except OSError as exc:  # a directory, or missing: python's own error comes from a cold start
        return f"cannot read script {head!r}: {exc.strerror}"
    return WarmPlan("script", head, rest)


def startup_mismatch(server_env: Mapping[str, str], env: Mapping[str, str]) -> str | None:
    """Name the first start-up variable whose value differs, or None."""
    for key in sorted(set(server_env) | set(env)):
        if key.startswith(STARTUP_ENV_PREFIXES) and server_env.get(key) != env.get(key):
            return f"{key}={env.get(key)!r} differs from the fork server's {server_env.get(key)!r}"
    return None


def main_path0(p: WarmPlan, cwd: str) -> str:
    """sys.path[0] of a fresh ``python -u``: the script's real directory, the cwd (-m), '' (-c)."""
    if p.kind == "script":
        return os.path.dirname(os.path.realpath(os.path.join(cwd, p.target)))
    return os.path.realpath(cwd) if p.kind == "module" else ""


def set_child_subreaper(on: bool = True) -> bool:
    """Make this process adopt (or stop adopting) orphaned descendants; False if impossible.

    Only processes forked after this call re-parent their orphans to us.
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, int(on), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reap_group_orphans(pgid: int) -> int:
    """Reap our children in process group ``pgid`` (adopted orphans) until none is left.

    Blocks while such a child lives: call it after the group was SIGKILLed,
    from a thread that may wait.  Returns how many were reaped.  Without
    the subreaper flag we have no children there: one syscall, returns 0.
    """
    n = 0
    with contextlib.suppress(ChildProcessError):
        while os.waitid(os.P_PGID, pgid, os.WEXITED) is not None:
            n += 1
    return n


class WarmChild:
    """A worker forked by the server and re-parented to us (quacks like Popen for the reaper)."""

    stdout = stderr = None

    def __init__(self, pid: int, go_fd: int) -> None:
        self.pid, self._go_fd = pid, go_fd
        self.returncode: int | None = None

    def release(self, go: bool = True) -> None:
        """Let the worker run user code (call once its reaper watches it); ``go=False``: make it exit."""
        fd, self._go_fd = self._go_fd, -1
        if fd >= 0:
            try:
                os.write(fd, b"g" if go else b"")
            finally:
                os.close(fd)

    def wait(self, timeout: float | None = None) -> int:
        """Reap (blocking; ``timeout`` is ignored: only called once the worker exited)."""
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode


class ForkServer:
    """Agent side: start, talk to, watch and kill one server process (restartable).

    ``start`` must run on the thread whose death should kill the server (the
    WorkerGroup's spawner thread: PDEATHSIG), after ``set_child_subreaper``.
    ``dead`` says why the current server is gone (a restart may help);
    ``broken`` why none can serve (preloading failed: restarts would not help).
    """

    def __init__(self, python: str, env: Mapping[str, str], cwd: str, path0: str) -> None:
        self.python, self.env, self.cwd, self.path0 = python, dict(env), cwd, path0
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._ready = self._closing = False
        self.broken: str | None = None
        self.dead: str | None = "not started"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self.dead is None and self.broken is None else None

    def start(self, preexec: Callable[[], None] | None) -> None:
        """Spawn the server; it becomes ready in the background (about one ``import torch``)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [self.python, "-u", os.path.abspath(forkserver_program.__file__), str(theirs.fileno()), self.path0]
        try:
            proc = subprocess.Popen(argv, env=self.env, cwd=self.cwd, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, start_new_session=True, preexec_fn=preexec,
                                    pass_fds=(theirs.fileno(),), close_fds=True)  # noqa: PLW1509
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        with self._lock:
            self._proc, self._sock, self._ready, self.dead = proc, ours, False, None
        threading.Thread(target=self._watch, args=(proc, ours), daemon=True,
                         name=f"ckptless-forkserver-{proc.pid}").start()

    def _watch(self, proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
        """Reaper of the server: on its death kill its group, reap, reap adopted leftovers."""
        try:
            os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
        except ChildProcessError:
            pass
        _signal_group(proc.pid, signal.SIGKILL)  # an intermediate fork may still be alive
        rc = proc.wait()
        reap_group_orphans(proc.pid)
        with self._lock:
            if self._proc is proc:
                if not self._ready:  # it may have said why before exiting: then a restart is no use
                    with contextlib.suppress(OSError, ValueError):
                        msg = _recv_json(sock, 0.0)
                        self.broken = str(msg["error"]) if msg and "error" in msg else None
                self.dead = self.dead or (f"exit code {rc}" if rc >= 0 else f"signal {-rc}")
                self._ready = False
            sock.close()
            if not self._closing and self.broken is None:
                log.warning("fork server (pid %d) died (%s)", proc.pid, self.dead)

    def ready(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the server's ready message; False if not (yet) ready."""
        with self._lock:
            sock = self._sock
            if self._ready or sock is None or self.dead is not None or self.broken is not None:
                return self._ready
        try:
            select.select([sock], [], [], timeout)  # outside the lock: spawn() must not wait on us
            with self._lock:
                if self._ready or sock is not self._sock:
                    return self._ready
                msg = _recv_json(sock, 0.0)
                if msg is not None and "error" in msg:
                    self.broken = str(msg["error"])
                elif msg is not None:
                    self._ready = True
                return self._ready
        except (OSError, ValueError) as exc:  # EOF or closed by the watcher: it died
            self.dead = self.dead or f"no ready message ({exc})"
            return False

    def spawn(self, p: WarmPlan, argv: Sequence[str], env: Mapping[str, str], cwd: str, stdout_fd: int,
              stderr_fd: int, timeout: float) -> WarmChild:
        """Ask the server for a worker; raises ForkServerError (then spawn cold)."""
        if not self.ready(0.0):
            raise ForkServerError(self.broken or self.dead or "fork server not ready yet (still importing)")
        mismatch = startup_mismatch(self.env, env)
        if mismatch is not None:
            raise ForkServerError(mismatch)
        req = {"kind": p.kind, "target": p.target, "args": list(p.args), "argv": list(argv), "env": dict(env),
               "cwd": cwd, "path0": main_path0(p, cwd), "agent": os.getpid()}
        with self._lock:
            sock = self._sock
            if sock is None:
                raise ForkServerError("fork server is gone")
            go_r, go_w = os.pipe()
            try:
                fds = array.array("i", [stdout_fd, stderr_fd, go_r])
                sock.sendmsg([json.dumps(req).encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
                reply = _recv_json(sock, timeout)
            except (OSError, ValueError) as exc:
                reply = {"error": self._fail(f"request failed: {exc}")}
            finally:
                os.close(go_r)
            if reply is None:  # hung: kill it, a late worker would wait for a go that never comes
                reply = {"error": self._fail(f"no reply in {timeout}s")}
        if "pid" not in reply:
            os.close(go_w)
            raise ForkServerError(f"fork server: {reply.get('error')}")
        return WarmChild(int(reply["pid"]), go_w)

    def _fail(self, reason: str) -> str:
        """Give up on the current server (lock held): kill it; the next cold spawn restarts one."""
        self.dead = self.dead or reason
        if self._proc is not None:
            _signal_group(self._proc.pid, signal.SIGKILL)
        return reason

    def close(self) -> None:
        """Kill the server for good (the group is stopping); its watcher thread reaps it."""
        with self._lock:
            self._closing = True
            if self._proc is not None and self.dead is None:
                _signal_group(self._proc.pid, signal.SIGKILL)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _recv_json(sock: socket.socket, timeout: float) -> dict[str, Any] | None:
    """One message, or None on timeout; the peer's EOF raises ConnectionResetError."""
    ready, _, _ = select.select([sock], [], [], timeout)
    if not ready:
        return None
    data = sock.recv(MAX_MSG)
    if not data:
        raise ConnectionResetError("fork server closed the connection")
    msg = json.loads(data)
    if not isinstance(msg, dict):
        raise ValueError("bad message")
    return msg
