"""The reference job of the recovery tests (and the demo): dropout, AdamW, LR schedule, resumable data.

Environment knobs for fault injection by the test (which sends the real signal):
  REF_STEPS        number of steps (default 12)
  REF_PAUSE_RANK / REF_PAUSE_STEP
                   that rank, when about to run that step (first incarnation only),
                   writes OUT/paused_rank<R>.json with its pid and blocks (bounded) so
                   the test can SIGKILL / SIGSTOP it exactly there.
  REF_PAUSE_RANK2 / REF_PAUSE_STEP2, REF_PAUSE_RANK3 / REF_PAUSE_STEP3
                   more pause points (announced as paused2_/paused3_rank<R>.json).
                   A pause step of -1 holds before job.run(): nothing of that rank is
                   captured or mirrored yet.
  REF_PAUSE_WHERE  ``optimizer``: the first pause point holds inside the step, after its all-reduce and
                   before ``opt.step()`` (default ``start``: before the step's forward)
  REF_PAUSE_COMMITTED
                   a version N: a pause point announces itself only once job.committed_version >= N
                   (bounded), so a test that kills there knows which version the survivors hold
                   (the rounds are asynchronous: on a busy machine v4 may still be in flight at step 6)
  REF_PAUSE_RELEASE
                   a file name NAME: pause point <N> ("" for the first, "2", "3") also ends
                   as soon as OUT/NAME<N> exists (the test lets the held rank go on).
  REF_EXIT_RANK / REF_EXIT_STEP / REF_EXIT_KIND
                   that rank, about to run that step (every incarnation, every time),
                   writes OUT/exiting_rank<R>.json ({pid, step, time}) and then fails
                   in the user's own code: KIND ``raise`` (default) raises ValueError,
                   ``exit:N`` calls sys.exit(N).
  REF_HIDDEN       hidden width (state size)
  REF_LOADER_WORKERS
                   DataLoader worker processes of the resumable loader (default 0): they are
                   forked after the groups formed and inherit the process's descriptors
  REF_UNSEEDED_DATA
                   if set, the setup shifts the data by draws from the global torch RNG (which
                   the script never seeds): a replacement's setup must draw the same numbers
  REF_SETUP_READS_RANK
                   if set, the setup reads os.environ["RANK"], shifts its (unprotected) data by it
                   and seeds torch, random and NumPy per rank, as scripts that shard data and seed
                   per rank at setup do: a pre-built spare built as another rank must not take this
                   rank with its objects as built. ``early``: the same, with RANK read at import,
                   before ckptless is imported (a module-level constant); any other value: after
                   ckptless.init(). Both give the same states.
  REF_LOOP_API     if set, train with ``for step in job.steps(n): with job.guard(): ...`` instead of run()
  REF_STUCK_AT_EXIT_RANK
                   that rank's process (RANK in its environment) registers, before ckptless.init(), an
                   atexit hook that blocks in native code (libc ``pause()``): its program ends, then its
                   teardown never does, as a destructor waiting on a peer that is gone at exit would
  REF_DEVICE       ``cuda``: train on the rank's GPU (``job.device``), deterministic algorithms on
                   (the GPU tests, tests/gpu: dropout then draws from the CUDA generator)
Writes OUT/final_rank<R>.pt (params, optimizer state, RNG draws, data position) and
OUT/pids_rank<R>.json (every pid that ran this rank).
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

# REF_SETUP_READS_RANK=early: the rank read before anything of ckptless is imported (nothing of it can
# see this line unless the process was watched from its first line: ckptless/worker/spare_site).
RANK_AT_IMPORT = os.environ.get("RANK") if os.environ.get("REF_SETUP_READS_RANK") == "early" else None

import numpy as np
import torch
import torch.distributed as dist

import ckptless
from ckptless.chaos.final_state import write_final_state
from ckptless.data import ResumableLoader, ResumableSampler


def _announce(path: str, doc: dict[str, object]) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def main() -> None:
    out = sys.argv[1]
    steps = int(os.environ.get("REF_STEPS", "12"))
    hidden = int(os.environ.get("REF_HIDDEN", "64"))
    if os.environ.get("REF_STUCK_AT_EXIT_RANK") not in (None, "") and \
            os.environ.get("REF_STUCK_AT_EXIT_RANK") == os.environ.get("RANK"):
        import atexit
        import ctypes

        atexit.register(ctypes.CDLL(None).pause)  # registered first: runs after ckptless's own hook
    job = ckptless.init()
    # The setup reads no rank (a pre-built spare may take any rank with it as built) and does not
    # seed: ckptless.init() seeds torch, random and numpy the same on every rank and incarnation.
    world = dist.get_world_size()
    recorded: list[int] = []

    def record_pid() -> None:
        """Which process ran this rank: written at its first step (a pre-built spare runs the setup
        as its standby rank before it is assigned one, so setup is not the moment to record it)."""
        if not recorded:
            recorded.append(os.getpid())
            with open(os.path.join(out, f"pids_rank{job.rank}.jsonl"), "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "role": job.ctx.role, "generation": job.generation}) + "\n")

    device = job.device if os.environ.get("REF_DEVICE") == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.use_deterministic_algorithms(True)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, hidden), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(hidden, 1)
    )
    with torch.no_grad():  # identical initial weights on every rank
        g = torch.Generator().manual_seed(42)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    data_gen = torch.Generator().manual_seed(5)
    xs, ys = torch.randn(256, 16, generator=data_gen), torch.randn(256, 1, generator=data_gen)
    if os.environ.get("REF_UNSEEDED_DATA"):
        xs = xs + 0.01 * torch.randn(xs.shape)  # the global generator, seeded by nobody but ckptless
    if os.environ.get("REF_SETUP_READS_RANK"):
        rank_at_setup = int(RANK_AT_IMPORT if RANK_AT_IMPORT is not None else os.environ["RANK"])
        xs = xs + 0.01 * rank_at_setup  # this rank's data, decided at setup and not protected
        torch.manual_seed(1000 + rank_at_setup)  # per-rank seeds (the streams are protected: restored)
        random.seed(1000 + rank_at_setup)
        np.random.seed(1000 + rank_at_setup)
    dataset = torch.utils.data.TensorDataset(xs, ys)
    loader = ResumableLoader(dataset, ResumableSampler(len(dataset), seed=3), batch_size=8,
                             num_workers=int(os.environ.get("REF_LOADER_WORKERS", "0")))
    job.protect(model=model, optimizer=opt, scheduler=sched, data=loader)

    pauses = {}
    for suffix in ("", "2", "3"):
        r, s = os.environ.get(f"REF_PAUSE_RANK{suffix}"), os.environ.get(f"REF_PAUSE_STEP{suffix}")
        if r is not None and s is not None:
            pauses[(int(r), int(s))] = suffix
    release = os.environ.get("REF_PAUSE_RELEASE")
    exit_at = None
    if os.environ.get("REF_EXIT_RANK") is not None and os.environ.get("REF_EXIT_STEP") is not None:
        exit_at = (int(os.environ["REF_EXIT_RANK"]), int(os.environ["REF_EXIT_STEP"]))
    exit_kind = os.environ.get("REF_EXIT_KIND", "raise")
    pause_where = os.environ.get("REF_PAUSE_WHERE", "start")
    pause_committed = int(os.environ.get("REF_PAUSE_COMMITTED", "-1"))

    # After the setup, the rank is job.rank: a pre-built spare ran the setup as its standby rank and,
    # with --spare-any-rank, may take another rank with its objects as built (the script's contract).
    def hold(step: int, where: str = "start") -> None:
        rank = job.rank
        key = (rank, step)
        # REF_PAUSE_WHERE moves the first pause point only; the others hold at the step's start.
        if key in pauses and job.ctx.role == "member" and where == (pause_where if not pauses[key] else "start"):
            committed_by = time.monotonic() + 60
            while (job.committed_version or -1) < pause_committed and time.monotonic() < committed_by:
                time.sleep(0.01)  # the mirror rounds run on their own thread, beside this held step
            _announce(os.path.join(out, f"paused{pauses[key]}_rank{rank}.json"), {"pid": os.getpid(), "step": step})
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # held here until the test's signal arrives
                if release and os.path.exists(os.path.join(out, release + pauses[key])):
                    break
                time.sleep(0.01)

    def user_failure(step: int) -> None:
        rank = job.rank
        if exit_at != (rank, step):
            return
        _announce(os.path.join(out, f"exiting_rank{rank}.json"), {"pid": os.getpid(), "step": step, "time": time.time()})
        if exit_kind.startswith("exit:"):
            sys.exit(int(exit_kind.split(":", 1)[1]))
        raise ValueError(f"REF_EXIT: deliberate user error on rank {rank} at step {step}")

    def train_step(step: int) -> None:
        record_pid()
        hold(step, "start")
        user_failure(step)
        x, y = loader.next_batch()
        x, y = x.to(device), y.to(device)
        noise = torch.randn(1).item() * 1e-3 + random.random() * 1e-3 + float(np.random.rand()) * 1e-3
        loss = torch.nn.functional.mse_loss(model(x), y) + noise
        opt.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        dist.all_reduce(flat)
        flat /= world
        off = 0
        for p in model.parameters():
            n = p.numel()
            p.grad.copy_(flat[off : off + n].view_as(p))
            off += n
        hold(step, "optimizer")
        opt.step()
        sched.step()

    if job.ctx.role == "spare":  # built and about to wait for a rank: tests read which process stood by
        _announce(os.path.join(out, f"standby_{os.getpid()}.json"), {"pid": os.getpid(), "rank": job.ctx.standby_rank})
    hold(-1)
    if os.environ.get("REF_LOOP_API"):  # the loop API: the same steps, driven by the script's own for loop
        for step in job.steps(steps):
            with job.guard():
                train_step(step)
        from ckptless.job import RunResult

        result = RunResult(steps, steps, job.committed_version, job.generation, job.recoveries)
    else:
        result = job.run(train_step, steps)
    write_final_state(out, job.rank, model, opt, sched, loader, result)
    job.close()


if __name__ == "__main__":
    main()
