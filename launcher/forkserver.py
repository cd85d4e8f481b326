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

This file is also the server's program, run by path: stdlib-only imports.
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
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

PRELOAD_ENV = "CKPTLESS_PRELOAD"
DEFAULT_PRELOAD = ("torch", "torch.distributed")
# Read once at interpreter / library load (hash seed, sys.path, stdio encoding,
# libgomp/OpenBLAS/MKL thread settings, loader): a worker whose env differs from
# the server's here would not behave like a fresh process, so it is spawned cold.
STARTUP_ENV_PREFIXES = ("PYTHON", "LD_", "LC_", "LANG", "TORCH_", "OMP_", "GOMP_", "KMP_", "MKL_",
                        "OPENBLAS_", "MALLOC_", "HOME", PRELOAD_ENV)
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_MAX_MSG = 4 << 20
_SERVER_SETUP_TIMEOUT = 10.0  # server side: the new worker reports its pid (ms normally)
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
        argv = [self.python, "-u", os.path.abspath(__file__), str(theirs.fileno()), self.path0]
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
    data = sock.recv(_MAX_MSG)
    if not data:
        raise ConnectionResetError("fork server closed the connection")
    msg = json.loads(data)
    if not isinstance(msg, dict):
        raise ValueError("bad message")
    return msg


# --- the server process (everything below runs only in ``python -u forkserver.py``) ---
_READY_SIGNALS: dict[int, Any] = {}
_PRCTL: Any = None


def _server_main(sock_fd: int, path0: str) -> None:
    """Preload, report ready, serve; returns (in a forked worker only) after running the script."""
    sock = socket.socket(fileno=sock_fd)
    if not sys.flags.safe_path:
        sys.path[0] = path0  # where the worker's own imports (and CKPTLESS_PRELOAD) are found
    t0 = time.monotonic()
    names = [*DEFAULT_PRELOAD, *(m.strip() for m in os.environ.get(PRELOAD_ENV, "").split(",") if m.strip())]
    try:
        import ctypes
        import importlib

        global _PRCTL
        _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
        for name in names:
            importlib.import_module(name)
        problem = _fork_safety_problem()
    except BaseException as exc:  # noqa: BLE001 - any preload failure disables warm spawns
        problem = f"preloading {names} failed: {type(exc).__name__}: {exc}"
    if problem is not None:
        sock.send(json.dumps({"error": problem}).encode())
        sys.exit(1)
    _READY_SIGNALS.update({s: signal.getsignal(s) for s in signal.valid_signals()})
    keep = _open_fds() - {sock_fd}
    sock.send(json.dumps({"ready": True, "pid": os.getpid(), "preloaded": names,
                          "seconds": time.monotonic() - t0}).encode())
    req, code = _serve(sock, keep)
    _run(req, code)


def _open_fds() -> set[int]:
    """Open descriptors (without the one listdir itself used)."""
    return {int(n) for n in os.listdir("/proc/self/fd") if os.path.lexists(f"/proc/self/fd/{n}")}


def _threads() -> list[str]:
    """Names of this process's OS threads."""
    out = []
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/comm") as f:  # exited meanwhile
            out.append(f.read().strip())
    return out


def _fork_safety_problem() -> str | None:
    """Why forking this process would not give a clean worker, or None."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "a preloaded module initialised CUDA, which does not survive fork"
    # One throw-away fork runs the libraries' pthread_atfork "prepare" handlers,
    # which park their idle threads (OpenBLAS starts one at import): from then
    # on this process is single-threaded, and every fork is checked for that.
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    threads = _threads()
    if len(threads) != 1 or threading.active_count() != 1:
        return f"{len(threads)} threads after preloading ({', '.join(threads)}): forking would lose them"
    return None


def _serve(sock: socket.socket, keep: set[int]) -> tuple[dict[str, Any], Any]:
    """Answer requests until the agent hangs up; returns only in a new worker."""
    while True:
        msg, anc, flags, _ = sock.recvmsg(_MAX_MSG, socket.CMSG_SPACE(3 * 4))
        if not msg:
            sys.exit(0)  # the agent closed its end
        fds: list[int] = []
        got: int | tuple[Any] | str
        for level, kind, data in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.extend(array.array("i", data[: len(data) - len(data) % 4]))
        try:
            if len(fds) != 3 or flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise ValueError(f"malformed request ({len(fds)} fds, flags {flags})")
            threads = _threads()
            if len(threads) != 1:
                raise RuntimeError(f"fork server has {len(threads)} threads ({', '.join(threads)})")
            req = json.loads(msg)
            got = _fork_worker(sock, req, fds, keep)
        except Exception as exc:  # noqa: BLE001 - reported to the agent, which spawns cold
            got = f"{type(exc).__name__}: {exc}"
        if isinstance(got, tuple):
            return req, got[0]  # we are the worker now
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"pid": got} if isinstance(got, int) else {"error": got}).encode())


def _fork_worker(sock: socket.socket, req: dict[str, Any], fds: list[int], keep: set[int]) -> int | tuple[Any]:
    """Server: fork an intermediate that forks the worker and exits; returns the worker's pid.

    The worker returns ``(code,)`` instead, after its set-up and the agent's go.
    The server replies only after reaping the intermediate: by then the worker
    has been re-parented to the agent, so the agent can waitid() on it.
    """
    sr, sw = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    mid = os.fork()
    if mid == 0:  # intermediate: fork the worker, exit
        try:
            if os.fork() != 0:
                os._exit(0)
            os.close(sr)
            return (_become_worker(sock, req, fds, sw, keep),)
        except BaseException as exc:  # noqa: BLE001 - never run user code after a failed set-up
            print(f"ckptless fork server: worker set-up failed: {exc!r}", file=sys.stderr)
            os._exit(1)
    os.close(sw)
    try:
        ready, _, _ = select.select([sr], [], [], _SERVER_SETUP_TIMEOUT)
        data = os.read(sr, 4) if ready else b""
    finally:
        os.close(sr)
        os.waitpid(mid, 0)
    if len(data) != 4:
        raise RuntimeError("the new worker did not report its pid")
    pid: int = struct.unpack("=i", data)[0]
    return pid


def _become_worker(sock: socket.socket, req: dict[str, Any], fds: list[int], sw: int, keep: set[int]) -> Any:
    """In the worker: become what ``python -u ...`` would be; wait for the agent's go."""
    os.setsid()  # own session and process group before the agent learns our pid
    os.write(sw, struct.pack("=i", os.getpid()))
    os.close(sw)
    out, err, go = fds
    os.close(sock.detach())  # detach: the socket object must not close a reused fd number later
    null = os.open(os.devnull, os.O_RDWR)
    for src, dst in ((null, 0), (out, 1), (err, 2)):
        os.dup2(src, dst)
    for fd in _open_fds() - keep - {0, 1, 2, go}:
        os.close(fd)
    for s, handler in _READY_SIGNALS.items():  # as right after the preload imports
        if s not in (signal.SIGKILL, signal.SIGSTOP) and handler is not None and signal.getsignal(s) != handler:
            signal.signal(s, handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    signal.set_wakeup_fd(-1)
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    _reseed()
    kind, target = req["kind"], req["target"]
    sys.argv = [{"module": "-m", "code": "-c"}.get(kind, target), *req["args"]]
    sys.orig_argv = list(req["argv"])
    if not sys.flags.safe_path:
        sys.path[0] = req["path0"]
    code: Any = None
    try:  # compile while the agent registers us; errors surface after the go, as python's
        if kind == "script":
            req["file"] = target if os.path.isabs(target) else os.path.join(os.getcwd(), target)
            with open(req["file"], "rb") as f:
                code = compile(f.read(), req["file"], "exec", dont_inherit=True)
        elif kind == "code":
            code = compile(target, "<string>", "exec", dont_inherit=True)
    except BaseException as exc:  # noqa: BLE001
        code = exc
    data = os.read(go, 1)
    os.close(go)
    if data != b"g":
        os._exit(1)  # the agent gave up on us (or died): never run user code
    _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != req["agent"]:  # the agent died before PDEATHSIG took effect
        os.kill(os.getpid(), signal.SIGKILL)
    return code


def _reseed() -> None:
    """Fresh per-process randomness, as a new interpreter would draw.

    torch seeds its default CPU generator non-deterministically at start-up
    (``torch.initial_seed()`` differs per process; CUDA generators use a fixed
    default and are untouched), Python's ``random`` and numpy's legacy global
    from OS entropy, multiprocessing draws a random authkey.
    """
    import random

    random.seed()
    if (torch := sys.modules.get("torch")) is not None:
        torch.default_generator.seed()
    if (np_random := sys.modules.get("numpy.random")) is not None:
        np_random.seed()
    if (mp_process := sys.modules.get("multiprocessing.process")) is not None:
        mp_process.current_process().authkey = os.urandom(32)


def _run(req: dict[str, Any], code: Any) -> None:
    """Run the script as ``__main__`` like the interpreter does; exceptions as python reports them."""
    import builtins
    import types
    from importlib.machinery import BuiltinImporter, SourceFileLoader

    main = types.ModuleType("__main__")
    env = main.__dict__
    env["__annotations__"] = {}
    env["__builtins__"] = builtins
    env["__loader__"] = BuiltinImporter
    sys.modules["__main__"] = main
    try:
        if req["kind"] == "module":
            import runpy

            runpy._run_module_as_main(req["target"], alter_argv=True)  # type: ignore[attr-defined]
            return
        if req["kind"] == "script":
            if isinstance(code, OSError):
                print(f"{sys.executable}: can't open file {req['file']!r}: [Errno {code.errno}] {code.strerror}",
                      file=sys.stderr)
                sys.exit(2)
            env["__loader__"] = SourceFileLoader("__main__", req["file"])
            env["__file__"], env["__cached__"] = req["file"], None
        if isinstance(code, BaseException):
            raise code
        exec(code, env)  # noqa: S102 - this is the user's script
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - python's top level: print it, exit 1
        _uncaught(exc)


def _uncaught(exc: BaseException) -> NoReturn:
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next  # hide the server's own frames, as a fresh interpreter has none
    sys.excepthook(type(exc), exc.with_traceback(tb), tb)  # the hook prints exc.__traceback__
    if isinstance(exc, KeyboardInterrupt):  # python dies by SIGINT then, so the parent sees it
        import atexit

        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    sys.exit(1)


if __name__ == "__main__":
    _server_main(int(sys.argv[1]), sys.argv[2])
