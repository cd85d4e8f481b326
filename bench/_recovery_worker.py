"""Training worker of bench/recovery.py (one process = one rank).

Usage:  _recovery_worker.py ckptless OUT     (under ckptless-run)
        _recovery_worker.py torchrun OUT     (under torchrun; DCP save / load)

State per rank is controlled: one parameter shard of BENCH_STATE_BYTES / 12 float32
elements plus its AdamW state (exp_avg, exp_avg_sq), i.e. ~BENCH_STATE_BYTES per rank
(every rank owns a distinct shard, as in FSDP / ZeRO). A step: a cheap deterministic
gradient, AdamW update of the whole shard, and one small all_reduce (so a dead peer
is seen by the collective, as in a real job).

BENCH_READ_RANK=1: the setup reads its rank (``dist.get_rank()`` right after ``ckptless.init()``, for a
per-rank seed); BENCH_SETUP_S (seconds, default 0): the setup also sleeps, as a real model's build takes
time (bench/spare_setup.py).

BENCH_STEP_SLEEP (seconds, default 0): each step also sleeps, releasing the CPU as a GPU step
does (bench/scale.py runs up to 32 ranks on two cores).

Fault injection (same idea as tests/harness/scripts/train_ref.py): BENCH_PAUSES="r:s,r:s,..."
lists (rank, step) points; the rank that is about to run step s writes
OUT/pause<i>.json ({"pid", "rank", "step"}) and holds (bounded) until the bench
SIGKILLs it. A pause point fires once (its file exists afterwards).
Timestamps (time.monotonic, one clock for every process on this host):
  ckptless: the goodput ledgers (--goodput-dir).
  torchrun: OUT/tr_rank<R>.jsonl lines {"inc", "t_start", "t_loaded", "t_first_step", ...}.
"""

from __future__ import annotations

import json
import os
import sys
import time

T_PROCESS = time.monotonic()  # before `import torch`
RSS_BEFORE_STATE = 0

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _announce(path: str, doc: dict[str, object]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def _pauses() -> list[tuple[int, int]]:
    raw = os.environ.get("BENCH_PAUSES", "")
    return [(int(a), int(b)) for a, b in (p.split(":") for p in raw.split(",") if p)]


def _maybe_pause(out: str, rank: int, step: int) -> None:
    for i, (r, s) in enumerate(_pauses()):
        if (r, s) != (rank, step):
            continue
        path = os.path.join(out, f"pause{i}.json")
        if os.path.exists(path):
            continue  # fired already (we are the replacement / restarted incarnation)
        _announce(path, {"pid": os.getpid(), "rank": rank, "step": step})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # held here until the bench's SIGKILL arrives
            time.sleep(0.005)


class Shard(torch.nn.Module):
    def __init__(self, numel: int, rank: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(numel))
        with torch.no_grad():  # cheap deterministic init: the bench times recovery, not init
            torch.arange(numel, out=self.w).remainder_(997).mul_(1e-3).add_(rank)


def _build(rank: int) -> tuple[Shard, torch.optim.Optimizer]:
    numel = max(1, int(os.environ["BENCH_STATE_BYTES"]) // 12)
    model = Shard(numel, rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, foreach=False)
    p = model.w
    # AdamW state exists from the start, so the protected / saved layout never changes.
    opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    p.grad = torch.zeros_like(p)
    return model, opt


STEP_SLEEP = float(os.environ.get("BENCH_STEP_SLEEP", "0"))  # a step that releases the CPU (as a GPU's)
SETUP_S = float(os.environ.get("BENCH_SETUP_S", "0"))  # extra setup time after init (bench/spare_setup.py)


def _step(model: Shard, opt: torch.optim.Optimizer, step: int) -> None:
    if STEP_SLEEP:
        time.sleep(STEP_SLEEP)
    p = model.w
    torch.mul(p.detach(), 1e-3 * (1 + step % 3), out=p.grad)
    opt.step()
    loss = p.detach()[:1024].sum().reshape(1)
    dist.all_reduce(loss)


def run_ckptless(out: str) -> None:
    import ckptless

    steps = int(os.environ.get("BENCH_STEPS", "20"))
    if os.environ.get("CKPTLESS_ROLE") == "spare":  # warm: torch and ckptless imported, about to wait
        _announce(os.path.join(out, f"spare_ready_{os.getpid()}.json"), {"pid": os.getpid(), "t": time.monotonic()})
    global RSS_BEFORE_STATE
    RSS_BEFORE_STATE = _memory()["rss"]  # torch + ckptless imported, nothing protected yet
    t_init_called = time.monotonic()
    job = ckptless.init()
    t_init = time.monotonic()
    # By default the setup reads no rank: a pre-built spare may then take any lost rank with its objects
    # as built (its values are replaced by the received image; only the layout, the same on every rank,
    # matters). BENCH_READ_RANK=1 (bench/spare_setup.py) reads it right after init, as most real scripts
    # do (a per-rank seed, master_process): a pre-built spare then restarts as any other rank it is given.
    t0 = time.monotonic()
    if os.environ.get("BENCH_READ_RANK"):
        torch.manual_seed(1000 + dist.get_rank())  # overwritten for the image by the restored RNG
    if SETUP_S:
        time.sleep(SETUP_S)  # the rest of a real setup (a model's build, a tokenizer, loaders), CPU released
    model, opt = _build(0)
    job.protect(model=model, optimizer=opt)
    t_built = time.monotonic()
    if job.ctx.role == "spare":  # built (a pre-built spare: as its standby rank) and about to wait
        _announce(os.path.join(out, f"spare_built_{os.getpid()}.json"), {"pid": os.getpid(), "t": t_built})
    recorded: list[int] = []

    def record() -> None:
        """At the first step, when the rank is final: which process ran it, and when it was built
        (a pre-built spare built before it was assigned: off the recovery's critical path)."""
        recorded.append(job.rank)
        with open(os.path.join(out, f"pids_rank{job.rank}.jsonl"), "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "role": job.ctx.role, "generation": job.generation,
                                "t_process": T_PROCESS, "t_init_called": t_init_called, "t_init": t_init}) + "\n")
        with open(os.path.join(out, f"built_rank{job.rank}.jsonl"), "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "generation": job.generation, "t0": t0,
                                "t_built": t_built}) + "\n")

    trace: list[tuple[int, int, int, int]] = []  # (step, generation, peak RSS, RSS) before each step

    def train_step(step: int) -> None:
        if not recorded:
            record()
        m = _memory()
        trace.append((step, job.generation, m["peak_rss"], m["rss"]))
        _maybe_pause(out, job.rank, step)
        _step(model, opt, step)

    job.run(train_step, steps)
    job.close()
    mem: dict[str, object] = dict(_memory())
    mem.update({"pid": os.getpid(), "rank": job.rank, "rss_before_state": RSS_BEFORE_STATE, "trace": trace,
                "mappings": _big_mappings(),
                "state_bytes": int(os.environ["BENCH_STATE_BYTES"])})
    _announce(os.path.join(out, f"mem_rank{job.rank}_{os.getpid()}.json"), mem)


def _big_mappings(min_rss: int = 8 << 20) -> list[tuple[int, int, str]]:
    """(size MiB, resident MiB, name) of every mapping with at least ``min_rss`` resident (smaps)."""
    out: list[tuple[int, int, str]] = []
    size, name = 0, ""
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                parts = line.split()
                if "-" in parts[0] and len(parts) >= 5:
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    size, name = hi - lo, (parts[5] if len(parts) > 5 else "[anon]")
                elif parts[0] == "Rss:" and int(parts[1]) * 1024 >= min_rss:
                    out.append((size >> 20, int(parts[1]) >> 10, name))
    except OSError:
        pass
    return out


def _memory() -> dict[str, int]:
    """Peak and current resident memory of this process (bytes), from /proc/self/status."""
    keys = {"VmHWM": "peak_rss", "VmRSS": "rss", "RssShmem": "rss_shmem"}
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in keys:
                out[keys[name]] = int(rest.split()[0]) * 1024
    return out


def run_torchrun(out: str) -> None:
    import torch.distributed.checkpoint as dcp

    steps = int(os.environ.get("BENCH_STEPS", "20"))
    save_at = int(os.environ.get("BENCH_SAVE_AT", "3"))
    ckpt = os.path.join(out, "dcp")
    inc = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rec: dict[str, object] = {"inc": inc, "pid": os.getpid(), "t_process": T_PROCESS, "t_init": time.monotonic()}
    model, opt = _build(rank)
    p = model.w
    state = {f"rank{rank}": {"w": p.detach(), **opt.state[p]}}
    start = 0
    if inc > 0:
        dcp.load(state, checkpoint_id=ckpt)  # in place into the tensors above
        with open(os.path.join(ckpt, "step.json")) as f:
            start = int(json.load(f)["step"])
    rec["t_loaded"] = time.monotonic()
    for step in range(start, steps):
        if step == save_at and inc == 0:
            t0 = time.monotonic()
            dcp.save(state, checkpoint_id=ckpt)
            dist.barrier()
            if rank == 0:
                _announce(os.path.join(ckpt, "step.json"), {"step": step})
            with open(os.path.join(out, f"tr_rank{rank}.jsonl"), "a") as f:
                f.write(json.dumps({"inc": 0, "save_s": time.monotonic() - t0}) + "\n")
        _maybe_pause(out, rank, step)
        _step(model, opt, step)
        if step == start:
            rec["t_first_step"] = time.monotonic()
            rec["first_step"] = step
            with open(os.path.join(out, f"tr_rank{rank}.jsonl"), "a") as f:
                f.write(json.dumps(rec) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    {"ckptless": run_ckptless, "torchrun": run_torchrun}[sys.argv[1]](sys.argv[2])
