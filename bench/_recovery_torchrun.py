"""The baseline of bench/recovery.py: torchrun restarts every rank after a SIGKILL and each
reloads a DCP checkpoint, with that checkpoint cold (dropped from the page cache) or warm.

Why its own module: it measures another system (torchrun + torch.distributed.checkpoint) with its
own worker mode and its own timestamps (``tr_rank<R>.jsonl``), sharing with the ckptless side only
the plumbing in :mod:`_recovery_common`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _recovery_common import MIB, PY, WORKER, child_env, kill_group, settle_s, wait_file


def _drop_cache(d: Path) -> tuple[int, int]:
    """fsync + POSIX_FADV_DONTNEED every file under d; returns (bytes, bytes still cached)."""
    total = 0
    for f in d.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total, _cached_bytes(d)


def _cached_bytes(d: Path) -> int:
    files = [str(f) for f in d.rglob("*") if f.is_file()]
    if not files or shutil.which("fincore") is None:
        return -1
    r = subprocess.run(["fincore", "-b", "-n", "-o", "RES", *files], capture_output=True, text=True)
    return sum(int(x) for x in r.stdout.split() if x.isdigit())


@dataclass
class Restart:
    size: int
    world: int
    cache: str
    total: float
    restart: float  # t_kill -> last rank through init_process_group
    load: float  # -> last rank DCP-loaded
    step: float  # -> last rank's first step done
    cached_bytes: int
    save_s: float


def run_torchrun(size: int, world: int, caches: list[str], workdir: Path, log: Any) -> list[Restart]:
    out = workdir / f"torchrun-{uuid.uuid4().hex[:6]}"
    out.mkdir(parents=True)
    save_at, victim = 3, 1
    pauses = [(victim, save_at + 2)] * len(caches)
    env = child_env({"BENCH_STATE_BYTES": str(size), "BENCH_STEPS": str(save_at + 4),
                     "BENCH_SAVE_AT": str(save_at), "BENCH_PAUSES": ",".join(f"{r}:{s}" for r, s in pauses),
                     "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    lf = open(out / "torchrun.log", "wb")
    p = subprocess.Popen([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                          "--max-restarts", str(len(caches)), WORKER, "torchrun", str(out)],
                         env=env, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
    results: list[Restart] = []
    try:
        for i, cache in enumerate(caches):
            doc = wait_file(out / f"pause{i}.json", 300, [p])
            time.sleep(settle_s(size, world))
            cached = _drop_cache(out / "dcp")[1] if cache == "cold" else _cached_bytes(out / "dcp")
            t_kill = time.monotonic()
            os.kill(int(doc["pid"]), signal.SIGKILL)
            deadline = time.monotonic() + 180
            while True:
                recs = {}
                for r in range(world):
                    f = out / f"tr_rank{r}.jsonl"
                    if f.exists():
                        for line in f.read_text().splitlines():
                            d = json.loads(line)
                            if d["inc"] == i + 1:
                                recs[r] = d
                if len(recs) == world:
                    break
                if time.monotonic() > deadline or p.poll() is not None:
                    raise RuntimeError(f"torchrun restart {i} did not finish (rc={p.poll()})")
                time.sleep(0.05)
            save_s = 0.0
            for line in (out / "tr_rank0.jsonl").read_text().splitlines():
                save_s = max(save_s, json.loads(line).get("save_s", 0.0))
            res = Restart(size, world, cache, max(d["t_first_step"] for d in recs.values()) - t_kill,
                          max(d["t_init"] for d in recs.values()) - t_kill,
                          max(d["t_loaded"] for d in recs.values()) - t_kill,
                          max(d["t_first_step"] for d in recs.values()) - t_kill, cached, save_s)
            results.append(res)
            log(f"  torchrun+DCP S={size // MIB} MiB W={world} restart {i} ({cache}, {cached} B cached at kill, "
                f"load avg {os.getloadavg()[0]:.1f}): "
                f"init={res.restart:.3f} loaded={res.load:.3f} first_step={res.total:.3f}")
        if p.wait(300) != 0:
            raise RuntimeError(f"torchrun exited {p.returncode}")
    except BaseException:
        lf.flush()
        log("--- torchrun.log\n" + (out / "torchrun.log").read_text(errors="replace")[-4000:])
        raise
    finally:
        kill_group(p)
        lf.close()
        shutil.rmtree(out / "dcp", ignore_errors=True)
    return results
