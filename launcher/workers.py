"""Local worker processes: spawn, reap at once, signal, stop without orphans.

Why not torch's ``PContext``: it learns of a death by polling every
``monitor_interval`` and only for the whole group; recovery needs each
worker's exit (code or signal, with timestamps) the moment it happens so the
agent can record it in etcd within 100 ms, and it needs to respawn one rank.

Design:
* one reaper thread per worker blocks in ``waitid(WEXITED | WNOWAIT)``: the
  kernel wakes it at the exit, no polling interval.  WNOWAIT leaves the
  worker a zombie while we SIGKILL its process group, so the group id cannot
  have been reused by an unrelated process; then we reap and report.
* each worker is its own session, dies with its agent (PDEATHSIG, set from
  one long-lived spawner thread) and is signalled as a process group:
  launcher/worker_process.py, with :class:`WorkerExit`.
* output goes where torchrun's log layout says: launcher/worker_logs.py.
* ``warm=True``: respawns are forked from a per-agent fork server with torch
  already imported (launcher/forkserver.py: how the worker still ends up the
  agent's own child with PDEATHSIG tied to the agent); cold Popen whenever
  the server cannot serve, with the reason logged.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import TimeoutError as FutureTimeout
from typing import IO, Any

from ckptless.launcher import forkserver
from ckptless.launcher.args import Std
from ckptless.launcher.forkserver import ForkServer, ForkServerError, WarmChild
from ckptless.launcher.worker_env import substitute_local_rank
from ckptless.launcher.worker_logs import WorkerLogs, logs_for, make_log_layout, make_run_log_dir, pump
from ckptless.launcher.worker_process import (ProcessHandle, WorkerExit, kill, killpg, pdeathsig_preexec,
                                              spawn_thread)

from ckptless.errors import WorkerError

log = logging.getLogger(__name__)

_KILL_WAIT = 5.0  # after SIGKILL the kernel needs only ms; bounded anyway
_WARM_REPLY = 5.0  # a fork server answers in ms; past this it is killed and we spawn cold


class _Slot:
    """Mutable state of one local rank (guarded by WorkerGroup._lock)."""

    def __init__(self, argv: list[str], env: dict[str, str], logs: WorkerLogs) -> None:
        self.argv, self.env, self.logs = argv, env, logs
        self.proc: subprocess.Popen[bytes] | WarmChild | None = None
        self.warm = False  # the current incarnation came from the fork server
        self.incarnation = -1
        self.exit: WorkerExit | None = None
        self.done = threading.Event()
        self.files: list[IO[bytes]] = []
        self.pumps: list[threading.Thread] = []


class WorkerGroup:
    """The workers of one node; every method that blocks takes a timeout.

    ``on_exit`` is called from reaper threads, one call at a time (serialised),
    immediately after each exit; keep it short (record it, set an event).
    ``commands[i]`` gets torchrun's ``${local_rank}`` macro replaced by ``i``.
    Output: pass ``logs`` (see make_log_layout), or let the group build them
    from ``log_dir``/``redirects``/``tee`` like torchrun; it then also sets
    TORCHELASTIC_ERROR_FILE in each env.  With neither, workers write to the
    agent's console and TORCHELASTIC_ERROR_FILE stays as given.
    ``warm=True``: ``start`` also starts a fork server (torch preloaded) and
    ``respawn`` forks from it; initial spawns stay cold (the server is still
    importing then).  It makes this process a child subreaper.
    """

    def __init__(self, commands: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]],
                 on_exit: Callable[[WorkerExit], None] | None = None, *,
                 logs: Sequence[WorkerLogs] | None = None, log_dir: str | None = None,
                 redirects: Sequence[Std] | None = None, tee: Sequence[Std] | None = None,
                 local_ranks_filter: frozenset[int] | None = None, attempt: int = 0,
                 cwd: str | None = None, kill_group_on_exit: bool = True, warm: bool = False,
                 role: str = "default") -> None:
        n = len(commands)
        if len(envs) != n or (logs is not None and len(logs) != n) or not n:
            raise WorkerError(f"need one command, env (and logs) per worker: got {n}, {len(envs)}")
        env_list = [dict(e) for e in envs]
        if logs is None and (log_dir is not None or any(redirects or ()) or any(tee or ())):
            run_id = env_list[0].get("TORCHELASTIC_RUN_ID", "none")
            logs = make_log_layout(make_run_log_dir(log_dir, run_id), attempt, redirects or [Std.NONE] * n,
                                   tee or [Std.NONE] * n, local_ranks_filter)
            for env, lg in zip(env_list, logs):
                env["TORCHELASTIC_ERROR_FILE"] = lg.error_file or ""
        logs = logs or [WorkerLogs()] * n
        self._slots = [_Slot(substitute_local_rank(c, i), e, lg)
                       for i, (c, e, lg) in enumerate(zip(commands, env_list, logs))]
        self._on_exit = on_exit
        self._cwd = cwd
        self._kill_group_on_exit = kill_group_on_exit
        self._lock = threading.Lock()
        self._cb_lock = threading.Lock()
        self._stopping = False
        self._preexec = pdeathsig_preexec(os.getpid())
        self._server = self._make_server() if warm else None
        self._role = role  # tee'd console lines are prefixed "[<role><local_rank>]:", as torchrun does

    def _make_server(self) -> ForkServer | None:
        slot, cwd = self._slots[0], self._cwd or os.getcwd()
        plan = forkserver.plan(slot.argv, slot.argv[0], cwd)
        if isinstance(plan, str):
            log.warning("warm respawns disabled: %s", plan)
            return None
        if not forkserver.set_child_subreaper():
            log.warning("warm respawns disabled: cannot become a child subreaper (Linux only)")
            return None
        return ForkServer(slot.argv[0], slot.env, cwd, forkserver.main_path0(plan, cwd))

    # --- spawning ----------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self._slots)

    def start(self, timeout: float = 30.0, start_server: bool = True) -> dict[int, int]:
        """Spawn every worker; returns {local_rank: pid}.  On failure nothing is left running.

        ``start_server=False`` defers the fork server (see :meth:`start_server`): its
        ``import torch`` then does not compete with the workers' own start on a busy node.
        """
        try:
            for rank in range(self.size):
                self._spawn(rank, timeout)
            if start_server:
                self.start_server(timeout)
        except BaseException:
            self.stop(timeout=min(timeout, 5.0))
            raise
        return self.pids()

    @property
    def warm_enabled(self) -> bool:
        """This group respawns from a fork server (when it is up)."""
        return self._server is not None

    def start_server(self, timeout: float = 30.0) -> None:
        """Start the fork server (warm groups only; idempotent). Until it is ready, respawns are cold."""
        server = self._server
        if server is None or getattr(self, "_server_started", False):
            return
        self._server_started = True
        spawn_thread().submit(server.start, self._preexec).result(timeout=timeout)

    def respawn(self, local_rank: int, env_updates: Mapping[str, str] | None = None,
                timeout: float = 30.0) -> int:
        """Start a new incarnation of one (exited) worker with the same argv and env.

        ``env_updates`` lets the agent bump e.g. CKPTLESS_GENERATION.  Output
        files are appended to, so the dead incarnation's log survives.
        """
        slot = self._slot(local_rank)
        with self._lock:
            if self._stopping:
                raise WorkerError(f"local rank {local_rank}: group is stopping, not respawning")
            if slot.proc is not None and not slot.done.is_set():
                raise WorkerError(f"local rank {local_rank} (pid {slot.proc.pid}) is still running")
            slot.env.update(env_updates or {})
        return self._spawn(local_rank, timeout, warm=True)

    def add_like(self, template: int, env_updates: Mapping[str, str], timeout: float = 30.0) -> int:
        """Start one more worker, with ``template``'s command and env plus ``env_updates``; its local rank.

        Why: an agent that keeps N spares starts a new one after a spare took a rank (the taken
        spare keeps its slot). Its output goes where the template's would, under its own local
        rank's directory when the template writes to files (torchrun's ``attempt_<n>/<local_rank>/``).
        """
        src = self._slot(template)
        with self._lock:
            if self._stopping:
                raise WorkerError("group is stopping, not adding a worker")
            lr = len(self._slots)
            logs = logs_for(src.logs, template, lr)
            env = dict(src.env, **env_updates)
            if logs.error_file:
                env["TORCHELASTIC_ERROR_FILE"] = logs.error_file
            self._slots.append(_Slot(list(src.argv), env, logs))
        self._spawn(lr, timeout, warm=True)
        return lr

    def warm_ready(self, timeout: float) -> bool:
        """Wait up to ``timeout`` until the fork server can serve respawns; False if it cannot."""
        return self._server is not None and self._server.ready(timeout)

    def forkserver_pid(self) -> int | None:
        """The fork server's pid while it runs (None: not warm, or dead)."""
        return self._server.pid if self._server is not None else None

    def spawned_warm(self, local_rank: int) -> bool:
        """True if the current incarnation of ``local_rank`` was forked by the fork server."""
        return self._slot(local_rank).warm

    def _spawn(self, rank: int, timeout: float, warm: bool = False) -> int:
        fut = spawn_thread().submit(self._spawn_here, rank, warm)
        try:
            return fut.result(timeout=timeout)
        except FutureTimeout as exc:
            raise WorkerError(f"local rank {rank}: spawn did not finish in {timeout}s") from exc

    def _spawn_here(self, rank: int, warm: bool = False) -> int:
        """Runs on the spawner thread."""
        slot = self._slots[rank]
        mode = "ab" if slot.incarnation >= 0 else "wb"
        self._close_files(slot)
        lg = slot.logs
        out, out_tee = self._stream(slot, lg.stdout, lg.tee_stdout, mode)
        err, err_tee = self._stream(slot, lg.stderr, lg.tee_stderr, mode)
        got = self._spawn_warm(rank, out, err) if warm and self._server is not None else "cold"
        proc: subprocess.Popen[bytes] | WarmChild
        if isinstance(got, tuple):
            proc, pipes = got
        else:
            try:
                proc = subprocess.Popen(slot.argv, env=slot.env, cwd=self._cwd, stdin=subprocess.DEVNULL,
                                        stdout=out, stderr=err, start_new_session=True,
                                        preexec_fn=self._preexec, close_fds=True)  # noqa: PLW1509 - see pdeathsig_preexec
            except OSError as exc:
                self._close_files(slot)
                raise WorkerError(f"local rank {rank}: cannot start {slot.argv[0]!r}: {exc}") from exc
            pipes = [proc.stdout, proc.stderr]
            if warm:
                self._restart_server_if_dead()
        with self._lock:
            slot.proc, slot.exit, slot.warm = proc, None, isinstance(proc, WarmChild)
            slot.incarnation += 1
            slot.done = threading.Event()
            incarnation = slot.incarnation
        for pipe, fobj, fd in ((pipes[0], out_tee, 1), (pipes[1], err_tee, 2)):
            if pipe is not None and fobj is not None:
                t = threading.Thread(target=pump, args=(pipe, fobj, fd, f"[{self._role}{rank}]:".encode()),
                                     daemon=True, name=f"ckptless-tee-{rank}-{fd}")
                t.start()
                slot.pumps.append(t)
        try:
            threading.Thread(target=self._reap, args=(rank, proc, incarnation, slot.done), daemon=True,
                             name=f"ckptless-reaper-{rank}").start()
        except BaseException:
            if isinstance(proc, WarmChild):
                proc.release(go=False)  # unwatched: it exits without running user code
            raise
        if isinstance(proc, WarmChild):
            proc.release()  # watched now: let it run user code
        return proc.pid

    def _spawn_warm(self, rank: int, out: Any, err: Any) -> tuple[WarmChild, list[IO[bytes] | None]] | str:
        """Fork the worker from the server; the reason on failure (logged; caller spawns cold)."""
        assert self._server is not None
        slot, cwd = self._slots[rank], self._cwd or os.getcwd()
        plan = forkserver.plan(slot.argv, self._server.python, cwd)
        reason = plan if isinstance(plan, str) else ""
        fds: list[int] = []
        reads: list[IO[bytes] | None] = []
        ours: list[int] = []
        try:
            for arg, std in ((out, 1), (err, 2)):  # Popen's stdout/stderr arguments, as fds
                if arg == subprocess.PIPE:
                    r, w = os.pipe()
                    ours.append(w)
                    reads.append(open(r, "rb", buffering=0))  # noqa: SIM115 - the pump closes it
                    fds.append(w)
                else:
                    reads.append(None)
                    fds.append(std if arg is None else arg.fileno())
            if not isinstance(plan, str):
                return self._server.spawn(plan, slot.argv, slot.env, cwd, fds[0], fds[1], _WARM_REPLY), reads
        except ForkServerError as exc:
            reason = str(exc)
        finally:
            for fd in ours:
                os.close(fd)
        for f in reads:
            if f is not None:
                f.close()
        log.warning("local rank %d: cold respawn (%s)", rank, reason)
        return reason

    def _restart_server_if_dead(self) -> None:
        """Lazily, after a cold spawn: a dead fork server is replaced (import cost off the critical path)."""
        server = self._server
        if server is None or server.dead is None or server.broken is not None or self._stopping:
            return
        log.warning("fork server died (%s); starting a new one", server.dead)
        try:
            server.start(self._preexec)
        except OSError:
            log.exception("cannot restart the fork server; respawns stay cold")

    @staticmethod
    def _stream(slot: _Slot, path: str | None, tee: bool, mode: str) -> tuple[Any, IO[bytes] | None]:
        """Popen's stdout/stderr argument, and the file a tee pump copies into."""
        if path is None:
            return None, None
        f = open(path, mode)  # noqa: SIM115 - closed in _close_files
        slot.files.append(f)
        return (subprocess.PIPE, f) if tee else (f, None)

    @staticmethod
    def _close_files(slot: _Slot) -> None:
        for t in slot.pumps:
            t.join(timeout=1.0)
        slot.pumps.clear()
        for f in slot.files:
            f.close()
        slot.files.clear()

    # --- reaping -----------------------------------------------------------
    def _reap(self, rank: int, proc: ProcessHandle, incarnation: int, done: threading.Event) -> None:
        """Block until the worker exits; kill its group; reap; report. One thread per incarnation."""
        code: int | None = None
        sig: int | None = None
        try:
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
            mono, wall = time.monotonic(), time.time()
            if info is not None and info.si_code == os.CLD_EXITED:
                code = info.si_status
            elif info is not None:
                sig = info.si_status
            if self._kill_group_on_exit:
                killpg(proc.pid, signal.SIGKILL)  # still a zombie: the pgid is ours
            proc.wait()
        except (AttributeError, ChildProcessError, OSError):  # no waitid (macOS) or reaped elsewhere
            rc = proc.wait()
            mono, wall = time.monotonic(), time.time()
            code, sig = (rc, None) if rc >= 0 else (None, -rc)
        ex = WorkerExit(rank, proc.pid, incarnation, code, sig, mono, wall, requested=self._stopping)
        with self._lock:
            if self._slots[rank].incarnation == incarnation:
                self._slots[rank].exit = ex
        done.set()
        if self._on_exit is not None:
            with self._cb_lock:
                try:
                    self._on_exit(ex)
                except Exception:  # a broken callback must not kill the reaper silently
                    log.exception("on_exit callback failed for %s", ex)
        # Only a subreaper (warm) adopts the group's killed descendants; reap them (else a no-op).
        forkserver.reap_group_orphans(proc.pid)

    # --- observing ---------------------------------------------------------
    def _slot(self, local_rank: int) -> _Slot:
        if not 0 <= local_rank < self.size:
            raise WorkerError(f"no local rank {local_rank} (group has {self.size})")
        return self._slots[local_rank]

    def pids(self) -> dict[int, int]:
        """{local_rank: pid} of workers that have not exited (as far as the reaper knows)."""
        with self._lock:
            return {r: s.proc.pid for r, s in enumerate(self._slots) if s.proc and not s.done.is_set()}

    def exits(self) -> dict[int, WorkerExit]:
        """{local_rank: latest WorkerExit} for workers whose current incarnation ended."""
        with self._lock:
            return {r: s.exit for r, s in enumerate(self._slots) if s.exit is not None}

    def wait(self, timeout: float) -> dict[int, WorkerExit] | None:
        """Wait until every worker's current incarnation exited; None on timeout."""
        deadline = time.monotonic() + timeout
        for slot in list(self._slots):
            if slot.proc is None:
                continue
            if not slot.done.wait(max(0.0, deadline - time.monotonic())):
                return None
        return self.exits()

    # --- signalling and stopping -------------------------------------------
    def send_signal(self, local_rank: int, sig: int, group: bool = True) -> bool:
        """Send ``sig`` to one worker (its whole process group by default); False if it is gone."""
        slot = self._slot(local_rank)
        with self._lock:
            if slot.proc is None or slot.done.is_set():
                return False
            pid = slot.proc.pid
        return killpg(pid, sig) if group else kill(pid, sig)

    def signal_all(self, sig: int, group: bool = True) -> None:
        """Forward ``sig`` (e.g. SIGINT/SIGTERM the agent received) to every live worker."""
        for rank in range(self.size):
            self.send_signal(rank, sig, group)

    def stop(self, timeout: float = 30.0, sig: int = signal.SIGTERM) -> dict[int, WorkerExit]:
        """SIGTERM every process group, wait up to ``timeout``, then SIGKILL; no orphans.

        Exits caused by this call are reported with ``requested=True``.
        Raises WorkerError only if the kernel did not take a worker down
        within a few seconds of SIGKILL (a process stuck in the D state).
        """
        with self._lock:
            self._stopping = True
        self.signal_all(sig)
        if self.wait(timeout) is None:
            log.warning("workers still alive %.1fs after %s; sending SIGKILL", timeout, signal.Signals(sig).name)
            self.signal_all(signal.SIGKILL)
            if self.wait(_KILL_WAIT) is None:
                raise WorkerError(f"workers {sorted(self.pids())} survived SIGKILL for {_KILL_WAIT}s")
        for slot in self._slots:
            self._close_files(slot)
        if self._server is not None:
            self._server.close()
        return self.exits()

    def __enter__(self) -> WorkerGroup:  # noqa: PYI034 - typing.Self needs 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop(timeout=5.0)
