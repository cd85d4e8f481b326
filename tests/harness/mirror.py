"""Mirror engines on real Gloo groups, for tests that spawn one process per rank.

The images are seeded patterns (``pattern``) so any rank can tell a replica it holds is bitwise
its owner's; the config uses small chunks so a 256 KiB image takes many wire messages.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ckptless.mirror import MirrorConfig, MirrorEngine, PeerStore
from ckptless.state.checksum import chunk_checksums
from ckptless.state.manifest import Manifest

CHUNK = 4096


def pattern(owner: int, version: int, nbytes: int) -> torch.Tensor:
    """The bytes of ``owner``'s image of ``version`` (the same in every process)."""
    g = torch.Generator().manual_seed(owner * 100_003 + version)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def mirror_config(**kw: Any) -> MirrorConfig:
    """K = 1, 4 KiB chunks, 64 KiB wire messages, 20 s timeouts; ``kw`` overrides."""
    base: dict[str, Any] = {"replicas": 1, "chunk_bytes": CHUNK, "wire_bytes": 16 * CHUNK, "timeout_s": 20.0}
    base.update(kw)
    return MirrorConfig.build(**base)


def new_engine(job: str, generation: int = 0, store: PeerStore | None = None, **kw: Any) -> MirrorEngine:
    """An engine on a new Gloo group of every rank, configured by ``mirror_config(**kw)``."""
    return MirrorEngine(dist.new_group(backend="gloo"), job, mirror_config(**kw), generation=generation, store=store)


def fill(engine: MirrorEngine, version: int, nbytes: int, *, job: str, generation: int | None = None,
         corrupt: bool = False) -> tuple[Manifest, torch.Tensor]:
    """This rank's image of ``version`` in a buffer of the engine's pool, with its manifest (generation:
    the engine's unless given); ``corrupt`` flips a byte after checksumming."""
    buf = engine.acquire_buffer(nbytes, timeout=30)
    buf[:nbytes].copy_(pattern(engine.rank, version, nbytes))
    m = Manifest(job, engine.rank, version, engine.generation if generation is None else generation, nbytes, CHUNK,
                 tuple(chunk_checksums(buf, CHUNK, nbytes)), extra={"v": version})
    if corrupt:
        buf[nbytes // 2] ^= 0x5A  # flipped after checksumming: the replica must catch it
    return m, buf


def engine_pair(job: str, timeout_s: float, **kw: Any) -> list[MirrorEngine]:
    """Two engines of one job on a real Gloo pair in this process (one thread builds each rank's group),
    configured by ``mirror_config(timeout_s=timeout_s, **kw)``."""
    master = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=20), wait_for_workers=False)
    out: list[Any] = [None, None]

    def make(rank: int) -> None:
        store = master if rank == 0 else dist.TCPStore("127.0.0.1", master.port, 2, False,
                                                         timeout=timedelta(seconds=20))
        pg = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=timeout_s))
        out[rank] = MirrorEngine(pg, job, mirror_config(timeout_s=timeout_s, **kw), generation=0)

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def engine_world(job: str, world: int, timeout_s: float, node_of: list[str] | None = None,
                 books: list[Any] | None = None, **kw: Any) -> list[MirrorEngine]:
    """``world`` engines of one job on a real Gloo group in this process (one thread builds each rank's
    group), configured by ``mirror_config(timeout_s=timeout_s, **kw)``; ``books``: each rank's
    replica_check.StrikeBook (what the worker runtime hands its engines)."""
    master = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=20), wait_for_workers=False)
    out: list[Any] = [None] * world

    def make(rank: int) -> None:
        store = master if rank == 0 else dist.TCPStore("127.0.0.1", master.port, world, False,
                                                         timeout=timedelta(seconds=20))
        pg = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=timeout_s))
        out[rank] = MirrorEngine(pg, job, mirror_config(timeout_s=timeout_s, **kw), generation=0, node_of=node_of,
                                 strikes=None if books is None else books[rank])

    threads = [threading.Thread(target=make, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def init_gloo(rank: int, world: int, store_path: str) -> None:
    """The default group of this spawned rank: Gloo over a FileStore at ``store_path``."""
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))


def start_and_join(target: Callable[..., None], args: list[tuple[Any, ...]], timeout: float = 120) -> list[Any]:
    """One spawned process per ``args`` tuple, joined (killed if still alive after ``timeout``); returns them."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=a) for a in args]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
    return procs


def spawn_scenarios(worker: Callable[..., None], world: int, names: list[str], tmp: Path,
                    timeout: float) -> list[dict[str, Any]]:
    """``world`` spawned ranks of ``worker(rank, world, store, out_dir, names)``, each running the named
    scenarios; fails on a hung rank or any scenario's error; every rank's ``{name: result}``."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, world, str(tmp / "store"), str(tmp), names)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout)
            assert not p.is_alive(), "worker hung past its join timeout"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    results = []
    for r in range(world):
        with open(tmp / f"rank{r}.json") as f:
            res = json.load(f)
        assert "_fatal" not in res, res["_fatal"]
        for name in names:
            assert "error" not in res[name], f"rank {r} {name}:\n{res[name]['error']}"
        results.append(res)
    return results
