"""Benchmark: cost of continuous peer mirroring on the training step, and its throughput.

Run:  .venv/bin/python bench/mirror.py            (full: 64 MiB and 512 MiB per rank, K=1,2)
      .venv/bin/python bench/mirror.py --quick    (64 MiB, K=1 and 2, fewer steps)

4 ranks (processes) on one machine, Gloo over loopback. Per (state size, K):

* raw     - plain Gloo isend/irecv of the same bytes in the same pattern (each rank
            sends its state to its K holders, receives from the owners it holds).
* round   - one MirrorEngine round (header + manifest + chunked payload + checksum
            verification + commit all_reduce), run inline.
* steps   - a simulated step (single-thread matmul loop, calibrated to ~``--long``x
            the measured round time, plus a short-step case at ~``--short``x) without
            protection vs with capture (copy + CRC32C into a pool buffer) and a
            background mirror round every step. Overhead = relative increase of the
            mean step time; the final drain (waiting for the last commit) is reported apart.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

WORLD = 4
MIB = 1 << 20


def _barrier() -> None:
    dist.barrier()


def _raw_round(group: dist.ProcessGroup, rank: int, holders: tuple[int, ...], owners: tuple[int, ...],
               send: torch.Tensor, recv: dict[int, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    works = [dist.irecv(recv[o], group=group, group_src=o, tag=7) for o in owners]
    works += [dist.isend(send, group=group, group_dst=h, tag=7) for h in holders]
    for w in works:
        w.wait(timeout=timedelta(seconds=120))
    return time.perf_counter() - t0


def _compute(iters: int, a: torch.Tensor) -> None:
    x = a
    for _ in range(iters):
        x = torch.mm(a, x).clamp_(-1, 1)


def _steps(n: int, iters: int, a: torch.Tensor, engine: Any, state: torch.Tensor, start_version: int) -> dict[str, float]:
    from ckptless.state.checksum import chunk_checksums
    from ckptless.state.manifest import Manifest

    times: list[float] = []
    captures: list[float] = []
    waits: list[float] = []
    for i in range(n):
        t0 = time.perf_counter()
        _compute(iters, a)
        if engine is not None:
            w0 = time.perf_counter()
            buf = engine.acquire_buffer(state.numel())
            c0 = time.perf_counter()
            waits.append(c0 - w0)
            buf[: state.numel()].copy_(state)
            m = Manifest("bench", engine.rank, start_version + i, 0, state.numel(), engine.config.chunk_bytes,
                         tuple(chunk_checksums(buf, engine.config.chunk_bytes, state.numel())))
            engine.submit(m, buf)
            captures.append(time.perf_counter() - c0)
        times.append(time.perf_counter() - t0)
    out = {"step_s": statistics.mean(times), "capture_s": statistics.mean(captures) if captures else 0.0,
           "wait_s": statistics.mean(waits) if waits else 0.0}
    if engine is not None:
        d0 = time.perf_counter()
        assert engine.wait_committed(start_version + n - 1, timeout=300)
        out["drain_s"] = time.perf_counter() - d0
    return out


def worker(rank: int, store_path: str, out_path: str, cases: list[tuple[int, int]], args: dict[str, Any]) -> None:
    from ckptless.mirror import MirrorConfig, MirrorEngine, compute_placement
    from ckptless.state.checksum import chunk_checksums
    from ckptless.state.manifest import Manifest

    torch.set_num_threads(1)
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=300))
    a = torch.randn(args["mat"], args["mat"]) / args["mat"]
    t0 = time.perf_counter()
    _compute(20, a)
    per_iter = (time.perf_counter() - t0) / 20
    results = []
    version = 1
    for size_mib, k in cases:
        nbytes = size_mib * MIB
        state = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        pl = compute_placement(WORLD, k, "ring")
        holders, owners = pl.holders(rank), pl.owners_held_by(rank)
        raw_group = dist.new_group(backend="gloo")
        recv = {o: torch.empty(nbytes, dtype=torch.uint8) for o in owners}
        _barrier()
        _raw_round(raw_group, rank, holders, owners, state, recv)  # warm-up: touches pages
        raw = []
        for _ in range(args["reps"]):
            _barrier()
            raw.append(_raw_round(raw_group, rank, holders, owners, state, recv))
        del recv
        cfg = MirrorConfig.build(replicas=k, timeout_s=300.0, wire_bytes=args["wire_mib"] * MIB)
        inline = MirrorEngine(dist.new_group(backend="gloo"), "bench", cfg, background=False)
        rounds = []
        for i in range(args["reps"] + 1):
            buf = inline.acquire_buffer(nbytes)
            buf[:nbytes].copy_(state)
            m = Manifest("bench", rank, version, 0, nbytes, cfg.chunk_bytes, tuple(chunk_checksums(buf, cfg.chunk_bytes, nbytes)))
            _barrier()
            r0 = time.perf_counter()
            inline.submit(m, buf)
            if i:  # first round allocates the store's slots
                rounds.append(time.perf_counter() - r0)
            version += 1
        # Agree on one step length for all ranks: max round time -> iterations.
        t_round = torch.tensor([statistics.median(rounds), per_iter], dtype=torch.float64)
        dist.all_reduce(t_round, op=dist.ReduceOp.MAX)
        transfer, slowest_iter = float(t_round[0]), float(t_round[1])
        row: dict[str, Any] = {"size_mib": size_mib, "k": k, "raw_s": statistics.median(raw),
                               "round_s": statistics.median(rounds), "transfer_s": transfer}
        engine = MirrorEngine(dist.new_group(backend="gloo"), "bench", cfg, store=inline.store)
        _steps(cfg.pool_buffers, 1, a, engine, state, version)  # warm-up: first touch of the pool buffers
        version += cfg.pool_buffers
        for label, mult in (("long", args["long"]), ("short", args["short"])):
            iters = max(1, int(mult * transfer / slowest_iter))
            # Re-calibrate under the real contention (all 4 ranks computing at once).
            _barrier()
            trial = torch.tensor([_steps(1, iters, a, None, state, 0)["step_s"]], dtype=torch.float64)
            dist.all_reduce(trial, op=dist.ReduceOp.MAX)
            iters = max(1, int(iters * mult * transfer / float(trial[0])))
            _barrier()
            base = _steps(args["steps"], iters, a, None, state, 0)
            _barrier()
            prot = _steps(args["steps"], iters, a, engine, state, version)
            version += args["steps"]
            row[label] = {"iters": iters, "base": base, "mirror": prot}
        engine.close()
        del inline, engine
        results.append(row)
        _barrier()
    with open(out_path, "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _table(per_rank: list[list[dict[str, Any]]]) -> str:
    lines = ["| state/rank | K | raw Gloo p2p GB/s | mirror round GB/s | ratio | step (base) s | step (mirror) s "
             "| overhead | capture s | pool wait s | drain s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, row in enumerate(per_rank[0]):
        rows = [r[i] for r in per_rank]
        size, k = row["size_mib"], row["k"]
        sent = size * MIB * k / 1e9
        raw = max(r["raw_s"] for r in rows)
        rnd = max(r["round_s"] for r in rows)
        for label in ("long", "short"):
            base = max(r[label]["base"]["step_s"] for r in rows)
            mir = max(r[label]["mirror"]["step_s"] for r in rows)
            cap = max(r[label]["mirror"]["capture_s"] for r in rows)
            wait = max(r[label]["mirror"]["wait_s"] for r in rows)
            drain = max(r[label]["mirror"]["drain_s"] for r in rows)
            ratio = base / max(r["transfer_s"] for r in rows)
            lines.append(f"| {size} MiB | {k} | {sent / raw:.2f} | {sent / rnd:.2f} | {raw / rnd:.0%} | "
                         f"{base:.3f} ({label}, {ratio:.1f}x round) | {mir:.3f} | {(mir - base) / base:+.1%} | "
                         f"{cap:.3f} | {wait:.3f} | {drain:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="64 MiB only, fewer steps (~1 min)")
    ap.add_argument("--sizes", type=int, nargs="*", help="state MiB per rank (default 64 512)")
    ap.add_argument("--ks", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--long", type=float, default=5.0, help="long step = this x round time")
    ap.add_argument("--short", type=float, default=1.0, help="short step = this x round time")
    ap.add_argument("--wire-mib", type=int, default=16, help="MirrorConfig.wire_bytes in MiB")
    ap.add_argument("--mat", type=int, default=256, help="matmul size of the compute loop")
    ns = ap.parse_args(argv)
    sizes = ns.sizes or ([64] if ns.quick else [64, 512])
    steps = ns.steps or (4 if ns.quick else 5)
    cases = [(s, k) for s in sizes for k in ns.ks if not (s >= 512 and k > 1 and not ns.sizes)]
    args = {"steps": steps, "reps": ns.reps, "long": ns.long, "short": ns.short, "mat": ns.mat, "wire_mib": ns.wire_mib}
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        outs = [os.path.join(tmp, f"r{r}.json") for r in range(WORLD)]
        procs = [ctx.Process(target=worker, args=(r, os.path.join(tmp, "store"), outs[r], cases, args)) for r in range(WORLD)]
        t0 = time.perf_counter()
        for p in procs:
            p.start()
        for p in procs:
            p.join(900)
        for p in procs:
            if p.is_alive():
                p.kill()
                print("bench worker hung; killed", file=sys.stderr)
                return 1
        if any(p.exitcode for p in procs):
            print("bench worker failed", file=sys.stderr)
            return 1
        per_rank = []
        for o in outs:
            with open(o) as f:
                per_rank.append(json.load(f))
    print(f"4 ranks, {os.cpu_count()} cores, torch {torch.__version__}, Gloo loopback, {steps} steps/case, "
          f"wall {time.perf_counter() - t0:.0f}s")
    print(_table(per_rank))
    return 0


if __name__ == "__main__":
    sys.exit(main())
