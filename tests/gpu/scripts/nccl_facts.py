"""What torch's and NCCL's own machinery does to a recovery, measured on one GPU with several ranks.

Usage: nccl_facts.py OUT_DIR [--cpu]

Why: ckptless's NCCL path and its CPU stand-in (tests/harness/nccl_like.py) model four behaviours of
torch's ProcessGroupNCCL read from its sources (issue 36): the watchdog's dump key in the root store and
the heartbeat monitor that ends a process seeing it; the communicator lock an init in progress holds
(so an abort waits for ``TORCH_NCCL_NONBLOCKING_TIMEOUT``); a TCPStore client held by a blocking ``get``;
and ``wait()`` after an abort. This script checks each on real NCCL, plain torch (no ckptless), and
writes what it saw to ``OUT_DIR/nccl_facts.json`` (one entry per fact) with every process's log beside it.

Several ranks share the one GPU: each process gets its own ``NCCL_HOSTID`` (with ``NCCL_SOCKET_IFNAME=lo``,
``NCCL_IB_DISABLE=1``), so NCCL treats them as separate hosts and connects them over its socket
transport, the one that reports a dead peer on real clusters. ``--cpu`` runs the same choreography on
Gloo (no NCCL facts, only the script's own plumbing), for a machine without a GPU.

Facts (each a function below, run by the parent in order):
* ``hostid``: 3 processes, one GPU, one communicator: it forms and all-reduces (versions recorded).
* ``peer_death``: 3 ranks, rank 2 dies (os._exit) while the others enter an all-reduce with it; the
  survivors (``TORCH_NCCL_ASYNC_ERROR_HANDLING=2``) record whether and when their sync returns without
  an abort, what ``wait()`` says, then time ``abort()`` and the destructor. The parent records when the
  dump key appears in the root store.
* ``monitor``: after that, new processes form their first communicator on the same store server, with
  ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` short, and live 3 heartbeat timeouts: one with torch's defaults,
  one with ``TORCH_NCCL_ENABLE_MONITORING=0``, one with ``TORCH_NCCL_DUMP_ON_TIMEOUT=0``, one whose
  store is fresh (no key). Which of them torch ends, and when.
* ``init_abort``: rank 0 of a world-2 communicator whose rank 1 never comes: a thread in the
  non-blocking init's member check; ``abort()`` from another thread: how long it takes.
* ``uid_get``: rank 1 of a world-2 communicator whose rank 0 never comes: a thread in the unique-id
  ``get``; the same store client's ``add`` from another thread: how long it waits.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HEARTBEAT_S = 8
NONBLOCKING_S = 12
STORE_S = 12


def _versions() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        out["cuda"] = torch.version.cuda
        out["device"] = torch.cuda.get_device_name(0)
        try:
            out["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception as exc:  # noqa: BLE001 - recorded
            out["nccl"] = repr(exc)
        try:
            out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError) as exc:
            out["driver"] = repr(exc)
    return out


# --- children --------------------------------------------------------------------------------------
def _pg(store: dist.Store, rank: int, size: int, cpu: bool, name: str) -> Any:
    if cpu:
        return dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=60))
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=60)
    opts.config.blocking = 0
    opts.group_name = name
    return dist.ProcessGroupNCCL(store, rank, size, opts)


def _connect(pg: Any, cpu: bool) -> None:
    if not cpu:
        pg.eager_connect_single_device(torch.device("cuda", 0))


def _one(cpu: bool) -> torch.Tensor:
    return torch.ones(1) if cpu else torch.ones(1, device="cuda")


def _sync(cpu: bool) -> None:
    if not cpu:
        torch.cuda.synchronize()


def child(role: str, port: int, rank: int, size: int, out: Path, cpu: bool) -> None:
    if not cpu:
        torch.cuda.set_device(0)
    client = dist.TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=STORE_S if role == "uid_get" else 120))
    res: dict[str, Any] = {"role": role, "rank": rank, "pid": os.getpid()}

    def save() -> None:
        (out / f"{role}-{rank}.json").write_text(json.dumps(res))

    if role in ("hostid", "peer_death"):
        pg = _pg(dist.PrefixStore(f"{role}/", client), rank, size, cpu, role)
        t0 = time.monotonic()
        _connect(pg, cpu)
        x = _one(cpu)
        pg.allreduce([x]).wait()
        _sync(cpu)
        res["formed_s"], res["sum"] = round(time.monotonic() - t0, 3), float(x.item())
        save()
        if role == "hostid":
            return
        client.add("pd/formed", 1)
        client.wait(["pd/go"], timedelta(seconds=120))
        if rank == size - 1:
            os._exit(0)  # the peer dies before the all-reduce
        client.wait(["pd/dead"], timedelta(seconds=120))
        y = _one(cpu)
        t0 = time.monotonic()
        work = pg.allreduce([y])
        res["enqueued_s"] = round(time.monotonic() - t0, 3)
        done: list[str] = []

        def sync() -> None:
            try:
                ok = work.wait()
                _sync(cpu)
                done.append(f"returned {ok} after {time.monotonic() - t0:.2f}s")
            except Exception as exc:  # noqa: BLE001 - recorded
                done.append(f"raised after {time.monotonic() - t0:.2f}s: {type(exc).__name__}: {str(exc)[:300]}")

        th = threading.Thread(target=sync, daemon=True)
        th.start()
        th.join(25)
        res["without_abort"] = done[0] if done else "still blocked after 25s"
        t1 = time.monotonic()
        try:
            pg.abort()
            res["abort"] = f"returned after {time.monotonic() - t1:.2f}s"
        except Exception as exc:  # noqa: BLE001 - recorded
            res["abort"] = f"raised after {time.monotonic() - t1:.2f}s: {exc!r}"[:300]
        th.join(20)
        res["after_abort"] = done[-1] if done else "still blocked 20s after the abort"
        try:
            z = _one(cpu)
            pg.allreduce([z]).wait()
            _sync(cpu)
            res["next_collective"] = "returned"
        except Exception as exc:  # noqa: BLE001 - recorded
            res["next_collective"] = f"raised: {type(exc).__name__}: {str(exc)[:200]}"
        t2 = time.monotonic()
        del pg, work
        gc.collect()
        res["destructor_s"] = round(time.monotonic() - t2, 2)
        save()
        # Live on with a new communicator, as a survivor does, through 3 heartbeat timeouts.
        pg2 = _pg(dist.PrefixStore(f"pd-gen1/{rank}/", client), 0, 1, cpu, "gen1")
        _connect(pg2, cpu)
        end = time.monotonic() + 3 * HEARTBEAT_S
        while time.monotonic() < end:
            w = _one(cpu)
            pg2.allreduce([w]).wait()
            _sync(cpu)
            time.sleep(0.2)
        res["survived_s"] = 3 * HEARTBEAT_S
        save()
        return

    if role.startswith("monitor"):
        pg = _pg(dist.PrefixStore(f"{role}/", client), 0, 1, cpu, role)
        _connect(pg, cpu)
        t0 = time.monotonic()
        res["formed"] = True
        save()
        end = t0 + 3 * HEARTBEAT_S
        while time.monotonic() < end:
            w = _one(cpu)
            pg.allreduce([w]).wait()
            _sync(cpu)
            res["alive_s"] = round(time.monotonic() - t0, 1)
            save()
            time.sleep(0.5)
        res["survived"] = True
        save()
        return

    if role == "init_abort":
        pg = _pg(dist.PrefixStore("ia/", client), 0, 2, cpu, "ia")
        state: list[str] = []

        def form() -> None:
            try:
                _connect(pg, cpu)
                pg.allreduce([_one(cpu)]).wait()
                _sync(cpu)
                state.append("formed (unexpected)")
            except Exception as exc:  # noqa: BLE001 - recorded
                state.append(f"raised after {time.monotonic() - t0:.2f}s: {type(exc).__name__}: {str(exc)[:200]}")

        t0 = time.monotonic()
        th = threading.Thread(target=form, daemon=True)
        th.start()
        th.join(3)
        res["stuck_after_3s"] = th.is_alive()
        t1 = time.monotonic()
        pg.abort()
        res["abort_s"] = round(time.monotonic() - t1, 2)
        th.join(NONBLOCKING_S + 10)
        res["former"] = state[0] if state else "still blocked"
        res["former_released_s"] = round(time.monotonic() - t0, 2)
        save()
        return

    if role == "uid_get":
        pg_box: list[Any] = []
        state2: list[str] = []

        def build() -> None:
            try:
                pg_box.append(_pg(dist.PrefixStore("ug/", client), 1, 2, cpu, "ug"))
                _connect(pg_box[0], cpu)
                state2.append("connected (unexpected)")
            except Exception as exc:  # noqa: BLE001 - recorded
                state2.append(f"raised after {time.monotonic() - t0:.2f}s: {type(exc).__name__}: {str(exc)[:200]}")

        t0 = time.monotonic()
        th = threading.Thread(target=build, daemon=True)
        th.start()
        th.join(2)
        t1 = time.monotonic()
        client.add("ug/other", 1)  # another thread's operation on the same client
        res["add_waited_s"] = round(time.monotonic() - t1, 2)
        th.join(STORE_S + 10)
        res["builder"] = state2[0] if state2 else "still blocked"
        save()
        return
    raise SystemExit(f"unknown role {role}")


# --- parent ----------------------------------------------------------------------------------------
def _spawn(role: str, port: int, rank: int, size: int, out: Path, cpu: bool, host: str,
           extra: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    env = dict(os.environ, NCCL_HOSTID=host, NCCL_SOCKET_IFNAME="lo", NCCL_IB_DISABLE="1",
               CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0"),
               TORCH_NCCL_ASYNC_ERROR_HANDLING="2", TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=str(HEARTBEAT_S),
               TORCH_NCCL_NONBLOCKING_TIMEOUT=str(NONBLOCKING_S), NCCL_DEBUG="WARN", PYTHONUNBUFFERED="1")
    env.update(extra or {})
    log = open(out / f"{role}-{rank}.log", "wb")
    args = [sys.executable, __file__, str(out), "--child", role, str(port), str(rank), str(size)]
    if cpu:
        args.append("--cpu")
    return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)


def _read(out: Path, role: str, rank: int) -> dict[str, Any]:
    p = out / f"{role}-{rank}.json"
    return json.loads(p.read_text()) if p.exists() else {}


def _tail(out: Path, role: str, rank: int, n: int = 1500) -> str:
    p = out / f"{role}-{rank}.log"
    return p.read_bytes()[-n:].decode(errors="replace") if p.exists() else ""


def _finish(procs: list[subprocess.Popen[bytes]], timeout: float) -> list[int | None]:
    end = time.monotonic() + timeout
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.wait(max(0.1, end - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(None)
    return codes


def main(out: Path, cpu: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    facts: dict[str, Any] = {"versions": _versions(), "settings": {
        "heartbeat_timeout_s": HEARTBEAT_S, "nonblocking_timeout_s": NONBLOCKING_S, "store_timeout_s": STORE_S,
        "backend": "gloo (--cpu)" if cpu else "nccl"}}

    def save() -> None:
        (out / "nccl_facts.json").write_text(json.dumps(facts, indent=1))

    server = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=120), wait_for_workers=False)
    port = server.port
    t0 = time.monotonic()
    procs = [_spawn("hostid", port, r, 3, out, cpu, f"host{r}") for r in range(3)]
    codes = _finish(procs, 120)
    facts["hostid"] = {"exit_codes": codes, "ranks": [_read(out, "hostid", r) for r in range(3)],
                       "seconds": round(time.monotonic() - t0, 1)}
    if any(c != 0 for c in codes):
        facts["hostid"]["log_tail"] = _tail(out, "hostid", 0)
    save()

    # Fact 2 (and 4, 6): a peer dies; what the survivors' machinery does, and the dump key.
    procs = [_spawn("peer_death", port, r, 3, out, cpu, f"pd{r}") for r in range(3)]
    deadline = time.monotonic() + 120
    while server.add("pd/formed", 0) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    server.set("pd/go", "1")
    procs[2].wait(60)
    t_dead = time.monotonic()
    server.set("pd/dead", "1")
    key_at: float | None = None
    # Fact 3 starts once the survivors are in their hung all-reduce: watch for the dump key meanwhile.
    while time.monotonic() < t_dead + 30 and key_at is None:
        if server.check(["exception_dump"]):
            key_at = time.monotonic() - t_dead
        time.sleep(0.1)
    facts["peer_death"] = {"dump_key_after_s": None if key_at is None else round(key_at, 2),
                           "dump_key_value": server.get("exception_dump").decode(errors="replace")[:200]
                           if key_at is not None else None}
    save()

    # Fact 3: processes that form their first communicator after the key was written.
    variants = {"monitor_default": {}, "monitor_off": {"TORCH_NCCL_ENABLE_MONITORING": "0"},
                "monitor_nodump": {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}}
    mprocs = {k: _spawn(k, port, 0, 1, out, cpu, f"{k}", v) for k, v in variants.items()}
    fresh = dist.TCPStore("127.0.0.1", 0, None, True, timeout=timedelta(seconds=120), wait_for_workers=False)
    mprocs["monitor_fresh"] = _spawn("monitor_fresh", fresh.port, 0, 1, out, cpu, "fresh")
    started = time.monotonic()
    codes = _finish(procs[:2], 120)
    facts["peer_death"].update({"exit_codes": codes, "survivors": [_read(out, "peer_death", r) for r in range(2)],
                                "survivor_log_tails": [_tail(out, "peer_death", r) for r in range(2)]})
    save()
    mcodes = {k: c for k, c in zip(mprocs, _finish(list(mprocs.values()), 4 * HEARTBEAT_S + 60))}
    facts["monitor"] = {k: {"exit_code": mcodes[k], **_read(out, k, 0),
                            "log_tail": _tail(out, k, 0, 800)} for k in mprocs}
    facts["monitor"]["observed_s"] = round(time.monotonic() - started, 1)
    save()

    # Fact 4 and 5: an init in progress whose peer never comes; a unique-id get whose root never comes.
    if cpu:  # Gloo connects in its constructor: nothing of NCCL's to see
        print(json.dumps(facts, indent=1)[:6000])
        return
    a = _spawn("init_abort", port, 0, 2, out, cpu, "ia")
    b = _spawn("uid_get", port, 1, 2, out, cpu, "ug")
    ca, cb = _finish([a, b], NONBLOCKING_S + STORE_S + 60)
    facts["init_abort"] = {"exit_code": ca, **_read(out, "init_abort", 0), "log_tail": _tail(out, "init_abort", 0, 800)}
    facts["uid_get"] = {"exit_code": cb, **_read(out, "uid_get", 1), "log_tail": _tail(out, "uid_get", 1, 800)}
    save()
    print(json.dumps(facts, indent=1)[:6000])


if __name__ == "__main__":
    if "--child" in sys.argv:
        i = sys.argv.index("--child")
        role, port, rank, size = sys.argv[i + 1], int(sys.argv[i + 2]), int(sys.argv[i + 3]), int(sys.argv[i + 4])
        child(role, port, rank, size, Path(sys.argv[1]), "--cpu" in sys.argv)
        sys.stdout.flush()
        os._exit(0)
    main(Path(sys.argv[1]), "--cpu" in sys.argv)
