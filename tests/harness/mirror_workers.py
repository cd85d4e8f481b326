"""Worker processes for tests/e2e/test_mirror_transport.py (real Gloo, spawned).

Each worker runs a list of scenarios in order and writes ``{name: result}`` to
``out_dir/rank{r}.json``; a scenario's result is a dict of facts or
``{"error": traceback}``. Synchronisation is by collectives only (no sleeps).
"""

from __future__ import annotations

import json
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ckptless.errors import IntegrityError, StaleGeneration
from ckptless.mirror.store import StaleVersion
from ckptless.state.checksum import chunk_checksums
from ckptless.state.manifest import Manifest

from .mirror import CHUNK, fill, init_gloo, new_engine, pattern, rss_bytes

JOB = "test-job"


# --- scenarios ---------------------------------------------------------------------------------------
def sc_bitwise(world: int, rank: int) -> dict[str, Any]:
    eng = new_engine(JOB, replicas=world - 1)
    out: dict[str, Any] = {"equal": [], "committed": []}
    for v in (1, 2, 3):
        eng.submit(*fill(eng, v, 100_000 + 777 * v, job=JOB))
        assert eng.wait_committed(v, timeout=20)
        out["committed"].append(eng.committed_version)
        for o in eng.placement.owners_held_by(rank):
            img = eng.store.get(o, v)
            want = pattern(o, v, 100_000 + 777 * v)
            exp = Manifest(JOB, o, v, 0, want.numel(), CHUNK, tuple(chunk_checksums(want, CHUNK)), extra={"v": v})
            out["equal"].append(img is not None and torch.equal(img.buffer, want) and img.manifest == exp)
        own = eng.local_image(v)
        out["equal"].append(own is not None and torch.equal(own.buffer, pattern(rank, v, 100_000 + 777 * v)))
    eng.close()
    return out


def sc_corrupt_then_recover(world: int, rank: int) -> dict[str, Any]:
    eng = new_engine(JOB)
    eng.submit(*fill(eng, 1, 50_000, job=JOB))
    assert eng.wait_committed(1, timeout=20)
    eng.submit(*fill(eng, 2, 50_000, corrupt=(rank == 0), job=JOB))
    assert eng.wait_idle(timeout=20)
    out: dict[str, Any] = {"after_corrupt": eng.committed_version, "broken": eng.broken,
                           "corrupt_seen": {str(o): b for o, b in eng.history[-1].corrupt.items()}}
    held = eng.placement.owners_held_by(rank)
    out["still_has_v1"] = all(eng.store.get(o, 1) is not None for o in held)
    eng.submit(*fill(eng, 3, 50_000, job=JOB))
    assert eng.wait_committed(3, timeout=20)
    out["after_recover"] = eng.committed_version
    out["v1_released_v3_held"] = all(eng.store.versions(o)[-1] == 3 for o in held)
    try:  # a version older than the held one: every holder refuses it, engine breaks
        eng.submit(*fill(eng, 2, 50_000, job=JOB))
        eng.wait_idle(timeout=20)
        out["old_version"] = "accepted"
    except Exception:
        out["old_version"] = type(eng.error).__name__
    out["newest_intact"] = all(eng.store.latest(o) is not None and eng.store.latest(o).manifest.version == 3  # type: ignore[union-attr]
                               and torch.equal(eng.store.latest(o).buffer, pattern(o, 3, 50_000)) for o in held)  # type: ignore[union-attr]
    eng.close()
    return out


def sc_memory_flat(world: int, rank: int) -> dict[str, Any]:
    eng = new_engine(JOB)
    nbytes = 256 << 10
    src = pattern(rank, 0, nbytes)
    ptrs: tuple[list[int], list[int]] | None = None
    rss0 = 0
    for v in range(1, 201):
        buf = eng.acquire_buffer(nbytes, timeout=20)
        buf[:nbytes].copy_(src)
        buf[:8] = torch.tensor(list(v.to_bytes(8, "little")), dtype=torch.uint8)
        eng.submit(Manifest(JOB, rank, v, 0, nbytes, CHUNK, tuple(chunk_checksums(buf, CHUNK, nbytes))), buf)
        if v == 20:
            assert eng.wait_idle(timeout=20)
            ptrs, rss0 = (eng.pool_ptrs(), eng.store.slot_ptrs()), rss_bytes()
    assert eng.wait_committed(200, timeout=30)
    out = {"ptrs_stable": ptrs == (eng.pool_ptrs(), eng.store.slot_ptrs()), "rss_growth": rss_bytes() - rss0,
           "committed": eng.committed_version, "bytes_held": eng.store.bytes_held, "rounds": len(eng.history)}
    eng.close()
    return out


def sc_stale(world: int, rank: int) -> dict[str, Any]:
    """Rank 1 lags a generation behind; then a peer of another job. Both must be refused."""
    out: dict[str, Any] = {}
    for name, gen, job in (("generation", 1 if rank == 0 else 0, JOB), ("job", 0, JOB if rank == 0 else "other")):
        eng = new_engine(job, generation=gen)
        m, buf = fill(eng, 1, 10_000, generation=gen, job=job)
        try:
            eng.submit(m, buf)
            eng.wait_idle(timeout=20)
        except Exception:
            pass
        out[name] = type(eng.error).__name__ if eng.error is not None else "accepted"
        out[name + "_stale"] = isinstance(eng.error, StaleGeneration)
        out[name + "_held"] = eng.store.owners()
        eng.close()
    return out


SCENARIOS: dict[str, Callable[[int, int], dict[str, Any]]] = {
    "bitwise": sc_bitwise, "corrupt": sc_corrupt_then_recover, "memory": sc_memory_flat, "stale": sc_stale,
}


def worker(rank: int, world: int, store_path: str, out_dir: str, names: list[str]) -> None:
    results: dict[str, Any] = {}
    try:
        init_gloo(rank, world, store_path)
        for name in names:
            try:
                results[name] = SCENARIOS[name](world, rank)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
            dist.barrier()
        dist.destroy_process_group()
    except Exception:
        results["_fatal"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


__all__ = ["IntegrityError", "StaleVersion", "worker"]
