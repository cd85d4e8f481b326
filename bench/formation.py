"""Benchmark: what re-forming a generation's groups costs, as a function of W and of the number of groups.

Run (it starts W processes at once: take the heavy lock on a shared machine):

    flock /tmp/ckptless-heavy.lock timeout 900 .venv/bin/python bench/formation.py --json /tmp/formation.json
    .venv/bin/python bench/formation.py --worlds 2 4 --groups 1 4 --generations 3   (a quick look)

What it times (docs/scale.md, "Re-forming the groups at a recovery", has the table and the model):
for each W, W worker processes (``bench/_formation_worker.py``) share one TCPStore hosted here, as
a job's workers share their agent's, and form generation after generation through ckptless's own
code: ``groups.form_mirror_group`` (its arrive barrier, the lazy Gloo mirror group connected to
its agreement-tree and ring peers), then ``groups.bind_all`` (the second arrive barrier, then every
``RebindableGroup.build`` one after another: the default group and G ``new_group`` groups over all
W ranks), on Gloo and on the tests' NCCL-semantics backend (``CKPTLESS_CPU_BACKEND=nccl_like``:
a unique-id exchange through the store, then an eager full Gloo mesh moving the bytes, then the
member check's all-reduce). Between two generations each rank does what a failure does
(``abort.abort_now``, ``groups.release_all``) and waits for the reaper, untimed. In the same run:
torch's own path for the same W and G on Gloo (``init_process_group`` + G ``new_group``, each
connected and all-reduced once, then ``destroy_process_group``; the stand-in's counterpart is
ProcessGroupNCCL, which needs GPUs), and, at the largest G, a what-if that builds the groups in
parallel, one thread and one store connection per group (not what the product does).

Reported per (W, path, backend, G): the formation's wall time per generation (max over ranks of
its end minus a common start, median and range over the generations), its parts (the arrive
barriers, the mirror group, one group's build), the store operations of one extra generation run
over a counting store (keys looked up: a Python store has no ``multi_get``, so each shows as a
``wait`` and a ``get``), and the socket descriptors a rank holds more after the formation than
before. Each worker runs ``gc.freeze()`` after its imports, so the reaper's ``gc.collect()`` per
generation (untimed) costs milliseconds. On 2 cores W processes are idle most of a formation (they
wait on the store and on sockets), but at W = 16 the times include CPU contention; the load
average is recorded before and after each W. A full run takes about 3 minutes here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "bench" / "_formation_worker.py"
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

#: torch's NCCL settings as ckptless-run gives them (worker/nccl_env.py); they matter to the stand-in.
WORKER_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
              "TORCH_NCCL_ENABLE_MONITORING": "0", "OMP_NUM_THREADS": "1"}


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()
    dirty = " (working tree differs)" if git("status", "--porcelain", "--untracked-files=no") else ""
    return git("rev-parse", "--short", "HEAD") + dirty


def run_world(world: int, args: argparse.Namespace, deadline_s: float) -> list[dict[str, Any]]:
    """Start ``world`` workers on one store, wait for them, return their result files."""
    store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=timedelta(seconds=120), wait_for_workers=False,
                          use_libuv=True)
    out = tempfile.mkdtemp(prefix=f"formation-w{world}-")
    if True:  # the directory is kept when a rank fails (its logs)
        plan = {"world": world, "host": "127.0.0.1", "port": store.port, "backends": args.backends,
                "groups": args.groups, "generations": args.generations, "paths": args.paths, "out": out}
        plan_file = Path(out, "plan.json")
        plan_file.write_text(json.dumps(plan))
        env = {**os.environ, **WORKER_ENV, "PYTHONPATH": str(ROOT)}
        logs = [open(Path(out, f"rank{r}.log"), "w") for r in range(world)]
        procs = [subprocess.Popen([sys.executable, str(WORKER), str(plan_file), str(r)], env=env, cwd=ROOT,
                                  stdout=logs[r], stderr=subprocess.STDOUT) for r in range(world)]
        end = time.monotonic() + deadline_s
        try:
            for p in procs:
                p.wait(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
        for f in logs:
            f.close()
        failed = [r for r, p in enumerate(procs) if p.returncode != 0]
        if failed:
            for r in failed[:2]:
                tail = Path(out, f"rank{r}.log").read_text()[-3000:]
                print(f"--- rank {r} (exit {procs[r].returncode}) ---\n{tail}", file=sys.stderr)
            raise SystemExit(f"W = {world}: ranks {failed} failed (logs in {out})")
        results = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
        shutil.rmtree(out, ignore_errors=True)
        return results


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(world: int, ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (path, backend, G): the numbers the docs table quotes."""
    by_key: dict[tuple[str, str, int], list[list[dict[str, Any]]]] = {}
    for r in ranks:  # every rank ran the same rows in the same order
        for i, row in enumerate(r["rows"]):
            key = (row["path"], row["backend"], row["groups"])
            slots = by_key.setdefault(key, [])
            gen_index = sum(1 for x in r["rows"][:i] if (x["path"], x["backend"], x["groups"]) == key)
            while len(slots) <= gen_index:
                slots.append([])
            slots[gen_index].append(row)
    out = []
    for (path, backend, n_groups), gens in by_key.items():
        timed = [g for g in gens if not g[0]["counted"]]
        counted = [g for g in gens if g[0]["counted"]]
        per_gen = [max(row["seconds"] for row in g) for g in timed]
        builds = [s for g in timed for row in g for s in row["parts"].get("group_build", [])]
        arrive = [sum(row["parts"].get("arrive", [])) for g in timed for row in g]
        mirror = [sum(row["parts"].get("mirror_group", [])) for g in timed for row in g]
        groups_total = [sum(row["parts"].get("group_build", [])) for g in timed for row in g]
        ops: dict[str, int] = {}
        if counted:
            for row in counted[0]:
                for op, n in row.get("store_ops", {}).items():
                    ops[op] = ops.get(op, 0) + n
        out.append({
            "world": world, "path": path, "backend": backend, "groups": n_groups,
            "communicators": n_groups + 1 + (path != "torch"),  # default + G (+ the mirror group)
            "generations": len(per_gen),
            "formation_s_median": _median(per_gen), "formation_s_min": min(per_gen), "formation_s_max": max(per_gen),
            "per_generation_s": per_gen,
            "group_build_s_median": _median(builds), "groups_total_s_median": _median(groups_total),
            "arrive_s_median": _median(arrive) if path != "torch" else None,
            "mirror_s_median": _median(mirror) if path != "torch" else None,
            "store_ops_total": sum(ops.values()) if ops else None,
            "store_ops_per_rank": round(sum(ops.values()) / world, 1) if ops else None, "store_ops": ops,
            "sockets_opened_per_rank_max": max(row["sockets_opened"] for g in timed for row in g),
            "sockets_opened_per_rank_median": _median([row["sockets_opened"] for g in timed for row in g]),
        })
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'W':>3} {'path':9} {'backend':9} {'G':>3} {'form s (med, range)':>24} {'per group s':>11} "
          f"{'arrive s':>8} {'mirror s':>8} {'ops/rank':>8} {'sockets':>7}")
    for r in rows:
        def f(x: float | None, fmt: str = "{:.3f}") -> str:
            return "-" if x is None else fmt.format(x)
        rng = f"{r['formation_s_median']:.3f} ({r['formation_s_min']:.3f}-{r['formation_s_max']:.3f})"
        print(f"{r['world']:>3} {r['path']:9} {r['backend']:9} {r['groups']:>3} {rng:>24} "
              f"{f(r['group_build_s_median']):>11} {f(r['arrive_s_median']):>8} {f(r['mirror_s_median']):>8} "
              f"{f(r['store_ops_per_rank'], '{:.1f}'):>8} {r['sockets_opened_per_rank_max']:>7}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--groups", type=int, nargs="+", default=[1, 4, 16], help="user groups besides the default")
    ap.add_argument("--backends", nargs="+", default=["gloo", "nccl_like"], choices=["gloo", "nccl_like"])
    ap.add_argument("--paths", nargs="+", default=["torch", "ckptless", "parallel"],
                    choices=["torch", "ckptless", "parallel"])
    ap.add_argument("--generations", type=int, default=4, help="timed generations per configuration")
    ap.add_argument("--deadline", type=float, default=300.0, help="seconds one W may take")
    ap.add_argument("--json", type=Path, help="write the raw results here")
    args = ap.parse_args()
    args.groups = sorted(set(args.groups))
    meta: dict[str, Any] = {"command": shlex.join([Path(sys.executable).name, *sys.argv]), "commit": commit(),
            "torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), "worker_env": WORKER_ENV, "worlds": {}}
    rows: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for world in sorted(args.worlds):
        load_before = os.getloadavg()
        w0 = time.monotonic()
        try:
            ranks = run_world(world, args, args.deadline)
        except SystemExit as exc:  # keep what the smaller worlds measured
            meta["failed"] = f"{exc}"
            print(exc, file=sys.stderr)
            break
        summary = summarize(world, ranks)
        rows.extend(summary)
        meta["worlds"][str(world)] = {"load_before": load_before, "load_after": os.getloadavg(),
                                      "wall_s": round(time.monotonic() - w0, 1), "ranks": ranks}
        print_table(summary)
        print(f"W = {world}: {time.monotonic() - w0:.1f} s, load average {load_before[0]:.2f} -> "
              f"{os.getloadavg()[0]:.2f}", flush=True)
    meta["wall_s"] = round(time.monotonic() - t0, 1)
    print(f"commit {meta['commit']}, torch {meta['torch']}, {meta['wall_s']} s")
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
