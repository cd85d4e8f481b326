"""Benchmark: cost of continuous peer mirroring on the training step, its throughput, the
re-protection round after a recovery, and host memory per rank.

Run:  .venv/bin/python bench/mirror.py            (64 and 512 MiB per rank, K=1,2; cpu and sleep steps)
      .venv/bin/python bench/mirror.py --quick    (64 MiB, K=1 and 2, fewer steps)
      .venv/bin/python bench/mirror.py --recovery [--rates 0 64 128]   (post-recovery round, 256 MiB)
      .venv/bin/python bench/mirror.py --memory 1024:1 256:1 256:2      (peak RSS, MiB:pool_buffers)

4 ranks (processes) on one machine, Gloo over loopback. Step modes (``--step-mode``):

* cpu   - a single-thread matmul loop: the compute competes with mirroring for the 2 cores.
* sleep - the step sleeps: the CPU is released for the step time, as a GPU job's host
          thread is while its kernels run. Capture (copy + CRC32C) still runs on the CPU.

Per (state size, K): raw Gloo p2p of the same pattern; one MirrorEngine round inline;
steps at ~``--long``x and ~``--short``x the round time, without protection vs with capture
and a background round every step (overhead = relative increase of the mean step).

``--recovery``: gen 0 mirrors everything; rank 2 is then lost (its holder also drops its
image), gen 1 re-captures the resume version R and re-protects it with a partial round (the
replacement's own image plus the one it holds move) or, for comparison, a full round; steps
(5x the round) continue with mirroring every step. Reported: the first steps after the
recovery against steady mirrored steps, and when R committed, for each ``--rates`` cap.

``--memory``: per rank peak RSS (``VmHWM``), its shared-memory part and the /dev/shm bytes
of the rank's peer-store files, over a few rounds with the store in /dev/shm, against
(2 + 2K) x S (K = 1).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _ranks import run_ranks  # noqa: E402

WORLD = 4
MIB = 1 << 20
LOST = 2


def _raw_round(group: dist.ProcessGroup, holders: tuple[int, ...], owners: tuple[int, ...],
               send: torch.Tensor, recv: dict[int, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    works = [dist.irecv(recv[o], group=group, group_src=o, tag=7) for o in owners]
    works += [dist.isend(send, group=group, group_dst=h, tag=7) for h in holders]
    for w in works:
        if w is not None:
            w.wait(timeout=timedelta(seconds=120))
    return time.perf_counter() - t0


def _compute(iters: int, a: torch.Tensor) -> None:
    x = a
    for _ in range(iters):
        x = torch.mm(a, x).clamp_(-1, 1)


def _max(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def _make_step(mode: str, target_s: float, a: torch.Tensor, per_iter: float) -> Callable[[], None]:
    """A step of ~``target_s`` for every rank at once (cpu: re-calibrated under contention)."""
    if mode == "sleep":
        return lambda: time.sleep(target_s)
    iters = max(1, int(target_s / per_iter))
    dist.barrier()
    t0 = time.perf_counter()
    _compute(iters, a)
    iters = max(1, int(iters * target_s / _max(time.perf_counter() - t0)))
    return lambda: _compute(iters, a)


def _capture(engine: Any, state: torch.Tensor, version: int, waited: list[float] | None = None
             ) -> tuple[Any, torch.Tensor]:
    """What the job's capture does (Job.capture_and_mirror): a pool buffer (``waited`` gets the
    back-pressure) and the copy; the CRC32C is left to the engine's thread (no checksums in the
    manifest), unless BENCH_CAPTURE_CRC=1 (the capture before that change: copy + CRC here)."""
    from ckptless.state.checksum import chunk_checksums
    from ckptless.state.manifest import Manifest

    t0 = time.perf_counter()
    buf = engine.acquire_buffer(state.numel())
    if waited is not None:
        waited.append(time.perf_counter() - t0)
    buf[: state.numel()].copy_(state)
    sums = (tuple(chunk_checksums(buf, engine.config.chunk_bytes, state.numel()))
            if os.environ.get("BENCH_CAPTURE_CRC") == "1" else ())
    return Manifest("bench", engine.rank, version, engine.generation, state.numel(), engine.config.chunk_bytes,
                    sums), buf


def _steps(n: int, step: Callable[[], None], engine: Any, state: torch.Tensor, start_version: int) -> dict[str, Any]:
    times: list[float] = []
    captures: list[float] = []
    waits: list[float] = []
    for i in range(n):
        t0 = time.perf_counter()
        step()
        if engine is not None:
            c0 = time.perf_counter()
            engine.submit(*_capture(engine, state, start_version + i, waits))
            captures.append(time.perf_counter() - c0 - waits[-1])
        times.append(time.perf_counter() - t0)
    out: dict[str, Any] = {"step_s": statistics.mean(times), "capture_s": statistics.mean(captures) if captures else 0.0,
                           "wait_s": statistics.mean(waits) if waits else 0.0, "times": times}
    if engine is not None:
        d0 = time.perf_counter()
        assert engine.wait_committed(start_version + n - 1, timeout=300)
        out["drain_s"] = time.perf_counter() - d0
    return out


def _init(rank: int, store_path: str, args: dict[str, Any]) -> tuple[torch.Tensor, float]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=600))
    a = torch.randn(args["mat"], args["mat"]) / args["mat"]
    t0 = time.perf_counter()
    _compute(20, a)
    return a, _max((time.perf_counter() - t0) / 20)


def _state(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8).random_(0, 256)


# --- throughput and step overhead ---------------------------------------------------------------------
def throughput(rank: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    from ckptless.mirror import MirrorConfig, MirrorEngine, compute_placement

    a, per_iter = args["_a"], args["_per_iter"]
    results = []
    version = 1
    for size_mib, k in args["cases"]:
        nbytes = size_mib * MIB
        state = _state(nbytes)
        pl = compute_placement(WORLD, k, "ring")
        holders, owners = pl.holders(rank), pl.owners_held_by(rank)
        raw_group = dist.new_group(backend="gloo")
        recv = {o: torch.empty(nbytes, dtype=torch.uint8) for o in owners}
        dist.barrier()
        _raw_round(raw_group, holders, owners, state, recv)  # warm-up: touches pages
        raw = []
        for _ in range(args["reps"]):
            dist.barrier()
            raw.append(_raw_round(raw_group, holders, owners, state, recv))
        del recv
        cfg = MirrorConfig.build(replicas=k, timeout_s=300.0, wire_bytes=args["wire_mib"] * MIB)
        inline = MirrorEngine(dist.new_group(backend="gloo"), "bench", cfg, background=False)
        rounds = []
        for i in range(args["reps"] + 1):
            m, buf = _capture(inline, state, version)
            dist.barrier()
            r0 = time.perf_counter()
            inline.submit(m, buf)
            if i:  # the first round allocates the store's slots
                rounds.append(time.perf_counter() - r0)
            version += 1
        transfer = _max(statistics.median(rounds))
        row: dict[str, Any] = {"size_mib": size_mib, "k": k, "raw_s": statistics.median(raw),
                               "round_s": statistics.median(rounds), "transfer_s": transfer, "modes": {}}
        store = inline.store
        del inline  # its pool: the engine below has its own
        engine = MirrorEngine(dist.new_group(backend="gloo"), "bench", cfg, store=store)
        _steps(cfg.pool_buffers, lambda: None, engine, state, version)  # warm-up: first touch of the pool
        version += cfg.pool_buffers
        for mode in args["step_modes"]:
            for label, mult in (("long", args["long"]), ("short", args["short"])):
                step = _make_step(mode, mult * transfer, a, per_iter)
                dist.barrier()
                base = _steps(args["steps"], step, None, state, 0)
                dist.barrier()
                prot = _steps(args["steps"], step, engine, state, version)
                version += args["steps"]
                row["modes"][f"{mode}/{label}"] = {"base": base, "mirror": prot}
        engine.close()
        del engine
        results.append(row)
        dist.barrier()
    return results


# --- re-protection after a recovery ---------------------------------------------------------------------
def recovery(rank: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    from ckptless.mirror import MirrorConfig, MirrorEngine, PeerStore, compute_placement

    a, per_iter = args["_a"], args["_per_iter"]
    nbytes = args["recovery_mib"] * MIB
    state = _state(nbytes)
    pl = compute_placement(WORLD, 1, "ring")
    moved = frozenset({(pl.owners_held_by(LOST)[0], LOST), (LOST, pl.holders(LOST)[0])})
    out = []
    gen, version = 0, 1
    store = PeerStore("bench", 0)
    n_after = args["after_steps"]
    cfg0 = MirrorConfig.build(replicas=1, timeout_s=300.0, wire_bytes=args["wire_mib"] * MIB)
    eng = MirrorEngine(dist.new_group(backend="gloo"), "bench", cfg0, store=store)
    for _ in range(3):  # the step length: 5x a full round's time (all ranks idle otherwise)
        eng.submit(*_capture(eng, state, version))
        assert eng.wait_committed(version, timeout=300)
        version += 1
    round_s = _max(eng.history[-1].seconds)
    eng.close()
    for mode in args["step_modes"]:
        step = _make_step(mode, args["long"] * round_s, a, per_iter)
        for variant in ["none", "full"] + [f"partial@{r:g}" for r in args["rates"]]:
            rate = float(variant.split("@")[1]) * MIB if "@" in variant else 0.0
            cfg = MirrorConfig.build(replicas=1, timeout_s=300.0, wire_bytes=args["wire_mib"] * MIB,
                                     max_send_bytes_s=rate)
            eng = MirrorEngine(dist.new_group(backend="gloo"), "bench", cfg, generation=gen, store=store)
            for _ in range(2):  # every holder gets the image of `version`
                eng.submit(*_capture(eng, state, version))
                assert eng.wait_committed(version, timeout=300)
                version += 1
            steady = _steps(n_after, step, eng, state, version)
            version += n_after
            resume = version - 1
            eng.close()
            # The recovery: rank LOST comes back with an empty store; its holder loses its image too.
            gen += 1
            if rank == LOST:
                store.close()
                store = PeerStore("bench", gen)
            elif rank == pl.holders(LOST)[0]:
                store.discard_newer(resume)
                store.drop(LOST, resume)
            store.discard_newer(resume)
            eng = MirrorEngine(dist.new_group(backend="gloo"), "bench", cfg, generation=gen, store=store)
            committed_at: list[float] = []

            def on_commit(v: int, r: int = resume, seen: list[float] = committed_at) -> None:
                if v >= r and not seen:
                    seen.append(time.perf_counter())
            eng.on_commit = on_commit
            dist.barrier()
            t0 = time.perf_counter()
            recapture = 0.0
            if variant != "none":  # "none": no re-protection round at all (the reference)
                m, buf = _capture(eng, state, resume)
                recapture = time.perf_counter() - t0
                eng.submit(m, buf, pairs=None if variant == "full" else moved)
            after = _steps(n_after, step, eng, state, resume + 1)
            version = resume + 1 + n_after
            hist = [h for h in eng.history if h.version == resume]
            out.append({"mode": mode, "variant": variant, "round_s": round_s, "recapture_s": recapture,
                        "steady": steady["times"], "after": after["times"],
                        "sent": hist[0].bytes_sent if hist else 0,
                        "commit_s": (committed_at[0] - t0) if committed_at and hist else None,
                        "round_after_s": hist[0].seconds if hist else 0.0})
            eng.close()
            dist.barrier()
    return out


# --- memory -------------------------------------------------------------------------------------------------
def _proc_status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, val = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssShmem", "RssFile"):
                out[key] = int(val.split()[0]) * 1024
    return out


def memory(rank: int, args: dict[str, Any]) -> list[dict[str, Any]]:
    from ckptless.mirror import MirrorConfig, MirrorEngine, PeerStore
    from ckptless.mirror.shm import holder_files

    out = []
    for size_mib, pool in args["mem_cases"]:
        shm = os.path.join(args["shm_root"], f"m{size_mib}p{pool}")
        os.makedirs(shm, exist_ok=True)
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS now (previous cases freed)
        fixed = _proc_status()["VmRSS"]
        nbytes = size_mib * MIB
        state = _state(nbytes)  # the live state (on a GPU job it would be device memory)
        cfg = MirrorConfig.build(replicas=1, timeout_s=300.0, pool_buffers=pool, shm_dir=shm,
                                 wire_bytes=args["wire_mib"] * MIB)
        store = PeerStore("bench", 0, shm, holder=rank)
        eng = MirrorEngine(dist.new_group(backend="gloo"), "bench", cfg, store=store)
        for v in range(1, args["mem_rounds"] + 1):
            time.sleep(0.05)
            eng.submit(*_capture(eng, state, v))
        assert eng.wait_committed(args["mem_rounds"], timeout=600)
        st = _proc_status()
        shm_bytes = sum(os.stat(os.path.join(shm, f.name)).st_blocks * 512
                        for f in holder_files(shm, "bench", None, rank))
        out.append({"size_mib": size_mib, "pool": pool, "fixed": fixed, "hwm": st["VmHWM"],
                    "shmem": st["RssShmem"], "shm_bytes": shm_bytes, "rounds": len(eng.history)})
        eng.close()
        store.close(unlink=True)
        del eng, store, state
        dist.barrier()
    return out


def worker(rank: int, store_path: str, out_path: str, args: dict[str, Any]) -> None:
    a, per_iter = _init(rank, store_path, args)
    args = dict(args, _a=a, _per_iter=per_iter)
    res = {"memory": memory, "recovery": recovery, "throughput": throughput}[args["kind"]](rank, args)
    with open(out_path, "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


def _run(args: dict[str, Any], timeout: float) -> list[Any] | None:
    return run_ranks(worker, WORLD, (args,), timeout)


# --- tables ----------------------------------------------------------------------------------------------------
def _throughput_table(per_rank: list[list[dict[str, Any]]]) -> str:
    lines = ["| state/rank | K | raw Gloo p2p GB/s | mirror round GB/s | ratio | step mode | step (base) s "
             "| step (mirror) s | overhead | capture s | overhead w/o capture | pool wait s | drain s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for i, row in enumerate(per_rank[0]):
        rows = [r[i] for r in per_rank]
        size, k = row["size_mib"], row["k"]
        sent = size * MIB * k / 1e9
        raw = max(r["raw_s"] for r in rows)
        rnd = max(r["round_s"] for r in rows)
        for key in row["modes"]:
            base = max(r["modes"][key]["base"]["step_s"] for r in rows)
            mir = max(r["modes"][key]["mirror"]["step_s"] for r in rows)
            cap = max(r["modes"][key]["mirror"]["capture_s"] for r in rows)
            wait = max(r["modes"][key]["mirror"]["wait_s"] for r in rows)
            drain = max(r["modes"][key]["mirror"]["drain_s"] for r in rows)
            ratio = base / max(r["transfer_s"] for r in rows)
            mode, label = key.split("/")
            lines.append(f"| {size} MiB | {k} | {sent / raw:.2f} | {sent / rnd:.2f} | {raw / rnd:.0%} | {mode} | "
                         f"{base:.3f} ({label}, {ratio:.1f}x round) | {mir:.3f} | {(mir - base) / base:+.1%} | "
                         f"{cap:.3f} | {(mir - cap - base) / base:+.1%} | {wait:.3f} | {drain:.3f} |")
    return "\n".join(lines)


def _recovery_table(per_rank: list[list[dict[str, Any]]], n: int) -> str:
    hdr = " | ".join(f"step {i + 1} s" for i in range(n))
    lines = [f"| step mode | re-protection | rate cap MiB/s | full round s | steady mirrored step s | re-capture s "
             f"| {hdr} | worst step vs none | R committed after s (steps) | R's round s | bytes sent (all ranks) |",
             "|---" * (10 + n) + "|"]
    none: dict[str, list[float]] = {}
    for i, row in enumerate(per_rank[0]):
        rows = [r[i] for r in per_rank]
        steady = statistics.mean(max(r["steady"][j] for r in rows) for j in range(1, n))  # step 0: fresh pool
        after = [max(r["after"][j] for r in rows) for j in range(n)]
        kind, _, rate = row["variant"].partition("@")
        if kind == "none":
            none[row["mode"]] = after
        ref = none.get(row["mode"], after)
        worst = max(a - b for a, b in zip(after, ref))
        commits = [r["commit_s"] for r in rows]
        commit = max(c for c in commits if c is not None) if all(c is not None for c in commits) else float("nan")
        lines.append(f"| {row['mode']} | {kind} | {rate or '-'} | {row['round_s']:.3f} | {steady:.3f} | "
                     f"{max(r['recapture_s'] for r in rows):.3f} | " + " | ".join(f"{t:.3f}" for t in after) +
                     f" | {worst:+.3f} s ({worst / steady:+.0%}) | {commit:.2f} ({commit / steady:.1f}) | "
                     f"{max(r['round_after_s'] for r in rows):.2f} | {sum(r['sent'] for r in rows) / MIB:.0f} MiB |")
    return "\n".join(lines)


def _memory_table(per_rank: list[list[dict[str, Any]]]) -> str:
    lines = ["| state S/rank | pool_buffers | fixed: RSS before S, GiB | peak RSS (VmHWM) GiB | of which shmem GiB "
             "| /dev/shm GiB | peak - fixed | budget (2+2K)S, K=1 | peak - fixed - budget | total peak, 4 ranks GiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    gib = float(1 << 30)
    for i, row in enumerate(per_rank[0]):
        rows = [r[i] for r in per_rank]
        s = row["size_mib"] * MIB
        grown = max(r["hwm"] - r["fixed"] for r in rows)
        lines.append(f"| {row['size_mib']} MiB | {row['pool']} | {max(r['fixed'] for r in rows) / gib:.2f} | "
                     f"{max(r['hwm'] for r in rows) / gib:.2f} | {max(r['shmem'] for r in rows) / gib:.2f} | "
                     f"{max(r['shm_bytes'] for r in rows) / gib:.2f} | {grown / s:.3f} x S | 4 x S | "
                     f"{(grown - 4 * s) / MIB:+.0f} MiB | {sum(r['hwm'] for r in rows) / gib:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="64 MiB only, fewer steps (~1 min)")
    ap.add_argument("--sizes", type=int, nargs="*", help="state MiB per rank (default 64 512)")
    ap.add_argument("--ks", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--step-mode", nargs="+", choices=["cpu", "sleep"], default=["cpu", "sleep"],
                    help="cpu: matmul loop; sleep: the step releases the CPU (a GPU job's host thread)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--long", type=float, default=5.0, help="long step = this x round time")
    ap.add_argument("--short", type=float, default=1.0, help="short step = this x round time")
    ap.add_argument("--wire-mib", type=int, default=16, help="MirrorConfig.wire_bytes in MiB")
    ap.add_argument("--mat", type=int, default=256, help="matmul size of the compute loop")
    ap.add_argument("--recovery", action="store_true", help="the re-protection round after a recovery instead")
    ap.add_argument("--recovery-mib", type=int, default=256)
    ap.add_argument("--rates", type=float, nargs="*", default=[0.0], help="--recovery: send caps, MiB/s (0: none)")
    ap.add_argument("--after-steps", type=int, default=4)
    ap.add_argument("--memory", nargs="*", metavar="MIB:POOL", help="peak memory per rank instead (K=1)")
    ap.add_argument("--mem-rounds", type=int, default=4)
    ap.add_argument("--shm-dir", default="/dev/shm")
    ap.add_argument("--json", help="write the raw per-rank results here")
    ns = ap.parse_args(argv)
    sizes = ns.sizes or ([64] if ns.quick else [64, 512])
    steps = ns.steps or (4 if ns.quick else 5)
    args: dict[str, Any] = {"steps": steps, "reps": ns.reps, "long": ns.long, "short": ns.short, "mat": ns.mat,
                            "wire_mib": ns.wire_mib, "step_modes": ns.step_mode, "recovery_mib": ns.recovery_mib,
                            "rates": ns.rates, "after_steps": ns.after_steps, "mem_rounds": ns.mem_rounds,
                            "cases": [(s, k) for s in sizes for k in ns.ks if not (s >= 512 and k > 1 and not ns.sizes)]}
    t0 = time.perf_counter()
    with open("/proc/loadavg") as f:
        load = " ".join(f.read().split()[:3])
    shm_root = None
    if ns.memory is not None:
        shm_root = tempfile.mkdtemp(prefix="ckptless-bench-", dir=ns.shm_dir)
        args.update(kind="memory", shm_root=shm_root,
                    mem_cases=[tuple(int(x) for x in c.split(":")) for c in (ns.memory or ["1024:1", "256:1", "256:2"])])
    else:
        args["kind"] = "recovery" if ns.recovery else "throughput"
    try:
        per_rank = _run(args, 3000)
    finally:
        if shm_root is not None:
            shutil.rmtree(shm_root, ignore_errors=True)
    if per_rank is None:
        return 1
    with open("/proc/loadavg") as f:
        load += " -> " + " ".join(f.read().split()[:3])
    print(f"{WORLD} ranks, {os.cpu_count()} cores, torch {torch.__version__}, Gloo loopback, "
          f"wall {time.perf_counter() - t0:.0f}s, load average (1/5/15 min) {load}")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(per_rank, f)
    if args["kind"] == "memory":
        print(_memory_table(per_rank))
    elif args["kind"] == "recovery":
        print(_recovery_table(per_rank, ns.after_steps))
    else:
        print(f"{steps} steps/case")
        print(_throughput_table(per_rank))
    return 0


if __name__ == "__main__":
    sys.exit(main())
