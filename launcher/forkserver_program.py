"""The fork server's own program: what runs inside ``python -u forkserver_program.py <fd> <path0>``.

The server (see launcher/forkserver.py for why warm respawns and how the
worker ends up the agent's child) preloads torch, torch.distributed,
``$CKPTLESS_PRELOAD`` and, where it imports, :data:`OPTIONAL_PRELOAD`, checks that forking it gives a clean single-threaded
process, and then answers spawn requests: it forks an intermediate that forks
the worker and exits, and the worker becomes what ``python -u script|-m
mod|-c code`` would have been, once the agent says "go".

Why a module of its own: this code never runs in the agent, only in the server
process and the workers it forks, and it is run by path, before the worker's
``sys.path`` is in place. So its top-level imports are the standard library's
only (nothing the worker would not have imported itself), and
:mod:`ckptless.environment` is imported with the preloads, once ``sys.path``
is the worker's. The agent's side (launcher/forkserver.py) imports this module
only for its path and the protocol's message limit.
"""

from __future__ import annotations

import array
import atexit
import contextlib
import gc
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from typing import Any, NoReturn

DEFAULT_PRELOAD = ("torch", "torch.distributed")
#: Imported too when they can be (a failure skips the module, it does not turn warm spawns off), unless
#: ``CKPTLESS_PRELOAD`` names them with a leading ``-``. ``torch._dynamo``: a script's first
#: ``torch.optim`` optimizer imports it (0.42 s here, 0.5-1 s at 32 ranks on two cores, measured for issue 35),
#: and a respawn's setup is on every survivor's path: they wait for it at the formation.
OPTIONAL_PRELOAD = ("torch._dynamo",)
MAX_MSG = 4 << 20  # one request or reply (a worker's env and argv), both directions
_PR_SET_PDEATHSIG = 1
_SERVER_SETUP_TIMEOUT = 10.0  # server side: the new worker reports its pid (ms normally)


_READY_SIGNALS: dict[int, Any] = {}
_PRCTL: Any = None


def _server_main(sock_fd: int, path0: str) -> None:
    """Preload, report ready, serve; returns (in a forked worker only) after running the script."""
    sock = socket.socket(fileno=sock_fd)
    if not sys.flags.safe_path:
        sys.path[0] = path0  # where the worker's own imports (and CKPTLESS_PRELOAD) are found
    t0 = time.monotonic()
    names = list(DEFAULT_PRELOAD)
    try:
        import ctypes
        import importlib

        from ckptless import environment  # the worker's own ckptless: sys.path[0] is its path now

        asked = [m.strip() for m in environment.current().preload.split(",") if m.strip()]
        removed = {m[1:] for m in asked if m.startswith("-")}
        names += [m for m in asked if not m.startswith("-") and m not in removed and m not in names]
        global _PRCTL
        _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
        for name in names:
            importlib.import_module(name)
        for name in OPTIONAL_PRELOAD:
            if name not in removed and name not in names:
                with contextlib.suppress(Exception):  # an older or trimmed torch: the script imports it itself
                    importlib.import_module(name)
                    names.append(name)
        # What the preloads made lives as long as any worker: frozen out of the cyclic GC here, a worker's
        # full collections scan only what it made itself. ckptless's run() collects once after the setup,
        # and on a respawn that held the GIL for 0.19 s (torch + torch._dynamo, measured for issue 35)
        # while the transfers of its image waited to start. (Frozen before forking also keeps a worker's
        # collections from writing to, so copying, the pages it shares with the server.)
        gc.collect()
        gc.freeze()
        # ... but at exit they are collectable again, as in a cold process: a frozen object is never freed,
        # and nanobind (triton's bindings, imported with torch._dynamo where triton is installed) then
        # prints "leaked N instances" on every warm worker's exit (CI's clean venv, issue 35).
        atexit.register(gc.unfreeze)
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
    _watch_rank_reads(req["env"])
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
        msg, anc, flags, _ = sock.recvmsg(MAX_MSG, socket.CMSG_SPACE(3 * 4))
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
    from ckptless import environment  # already imported, with the preloads (see _server_main)

    environment.install(req["env"])  # the environment its agent built for it, re-read
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


def _watch_rank_reads(env: dict[str, str]) -> None:
    """A spare's rank reads are watched from its script's first line, as the sitecustomize of
    ckptless/worker/spare_site does in a cold start (which ran in this server, not in the worker)."""
    from ckptless.worker import rank_reads  # imported with the preloads

    rank_reads.at_process_start(env)


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
