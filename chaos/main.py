"""``ckptless-chaos``: chaos on your own script, the fault-injected demo, single scenarios and the matrix.

    ckptless-chaos run    SCENARIO --script PATH [--nnodes N] [--nproc-per-node N] [--spares N]
                          [--env K=V ...] [--rank R] [--at S[,S]] [--hang-timeout S] [--out DIR] [-- ARGS...]
    ckptless-chaos demo   [--out DIR] [--steps N] [--baseline torchrun]
    ckptless-chaos goodput --script PATH [--every-s T | --schedule FILE] --duration-s D [--nnodes N]
                          [--nproc-per-node N] [--spares N] [--ckpt-every N] [--max-restarts M] [--seed S]
                          [--env K=V ...] [--json FILE] [--out DIR] [-- ARGS...]
    ckptless-chaos list
    ckptless-chaos run    NAME [--seed S] [--out DIR]     (NAME from `list`, or `random`: the matrix's demo job)
    ckptless-chaos run    long [--seed S] [--faults N] [--spares N] [--out DIR]   (>= 20 seeded faults in ONE job)
    ckptless-chaos matrix [--only a,b] [--seeds 1,2] [--out DIR]

Why one entry point for the demo and the matrix: the demo *is* a chaos
scenario (faults at exact steps, a fault-free twin, the bitwise verdict); it
only adds the goodput report. Exit status: 0 when every verdict is PASS,
1 when any FAIL, 2 for bad input (one line on stderr, no traceback).

The scenarios themselves (the matrix, ``random``, ``long``, the demo) are data in
:mod:`ckptless.chaos.catalogue`; this module only parses the command line, picks them
by name, runs them and prints the verdicts.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from ckptless import environment
from ckptless.chaos.catalogue import (
    DEMO_STEPS, LONG_SEED, catalogue, demo_faults, demo_job, long_scenario, random_scenario,
)
from ckptless.chaos.goodput_plan import RunFigures
from ckptless.chaos.long_schedule import LongConfig
from ckptless.chaos.scenario import (
    BaselineCache, Scenario, Verdict, render_fault_table, render_table, run_scenario,
)
from ckptless.chaos.script import (
    DEFAULT_HANG_TIMEOUT_S, SCRIPT_SCENARIOS, JobRun, ScriptJob, describe, render_details, run_script,
)
from ckptless.errors import CkptlessError, ConfigError


def _out_dir(arg: str | None, what: str) -> Path:
    if arg:
        return Path(arg).resolve()
    return Path(tempfile.mkdtemp(prefix=f"ckptless-chaos-{what}-"))


def _run_all(scenarios: list[Scenario], out: Path) -> list[Verdict]:
    cache = BaselineCache(out)
    verdicts = []
    for sc in scenarios:
        v = run_scenario(sc, out, cache)
        print(f"[{sc.name}] {'PASS' if v.passed else 'FAIL'} in {v.wall_s:.0f}s", flush=True)
        verdicts.append(v)
    return verdicts


def _demo(args: argparse.Namespace) -> int:
    from ckptless.cli import main as ckptless_cli
    from ckptless.report import load_run
    from ckptless.report import build_report

    out = _out_dir(args.out, "demo")
    job = demo_job(args.steps)
    faults = demo_faults(args.steps)
    t0 = time.monotonic()
    print(f"ckptless demo: {job.nnodes} nodes x {job.nproc_per_node} workers + a spare node with {job.spares} warm "
          f"spares, embedded etcd, {args.steps} steps of examples/train_demo.py (tiny transformer)", flush=True)
    print(f"  faults: {'; '.join(describe(f) for f in faults)} (--hang-timeout {job.hang_timeout:g})", flush=True)
    print(f"  output: {out}", flush=True)
    v = run_script("demo", job, out, faults=lambda _steps: faults, log=lambda line: print(line, flush=True))
    goodput = out / "demo" / "goodput"
    html = out / "report.html"
    measured = None  # (figures, goodput dir) of the torchrun + DCP run with the same faults
    if args.baseline == "torchrun" and v.faulty is not None:
        measured = _demo_torchrun(v.faulty, job, out)
    base = ["--baseline", str(measured[1])] if measured is not None else []
    print(f"\n== goodput report of the faulty run ({' '.join(['ckptless report', str(goodput), *base, '--html', str(html)])}) ==",
          flush=True)
    if goodput.is_dir():
        ckptless_cli(["report", str(goodput), *base, "--html", str(html)])
        sys.stdout.flush()
        rep = build_report(load_run(goodput))
        a, e = rep.analysis, rep.estimate
        print(f"\n== ckptless vs restart-from-disk, same {len(a.incidents)} failures ==")
        print(f"goodput with ckptless: {a.goodput:.1%} (measured: {a.productive_s:.1f}s productive of "
              f"{a.wall_s:.1f}s; failures cost {e.ckptless_failure_s:.1f}s)")
        if measured is not None:  # measured: the estimate only where no baseline ran
            tr = measured[0]
            tb = build_report(load_run(measured[1])).analysis
            print(f"goodput under torchrun + DCP: {tb.goodput:.1%} (MEASURED, the same faults at the same times: "
                  f"{tb.productive_s:.1f}s productive of {tb.wall_s:.1f}s, {tr.incidents} restarts, {tr.steps_lost} "
                  f"steps redone, checkpoint every {tr.extra.get('ckpt_every')} steps, "
                  f"{tr.extra.get('ckpt_every_source')}; {tr.ended})")
        else:
            print(f"goodput restarting from disk: {e.goodput:.1%} (ESTIMATE: failures would cost "
                  f"{e.failure_badput_s:.1f}s -- restart {e.inputs.restart_s:g}s + load {e.inputs.load_s:g}s + "
                  f"warm-up {e.warmup_s:.1f}s + steps since a checkpoint every {e.inputs.interval_steps} steps, each; "
                  f"see the report's estimate inputs; measure it with --baseline torchrun)")
        print(f"HTML report: {html}")
    print("\n== verdict: faulty run vs fault-free run (library digest of every protected object, RNG included) ==")
    print(render_details(v), end="")
    print(v.line)
    print(f"demo {'PASSED' if v.passed else 'FAILED'} in {time.monotonic() - t0:.0f}s")
    return 0 if v.passed else 1


def _goodput(args: argparse.Namespace, script_args: list[str]) -> int:
    """``goodput``: ckptless and torchrun + DCP on the same script and timed failures, side by side."""
    import json

    from ckptless.chaos.goodput import GoodputJob, compare
    from ckptless.chaos.goodput_plan import draw_schedule, load_schedule, render

    job = GoodputJob(Path(args.script).resolve(), tuple(script_args), nnodes=args.nnodes,
                     nproc_per_node=args.nproc_per_node, spares=args.spares, env=_env_pairs(args.env or []),
                     duration_s=args.duration_s)
    job.validate()
    if args.schedule:
        schedule = load_schedule(Path(args.schedule), job.world_size, job.duration_s)
        mtbf = job.duration_s / max(1, len(schedule))
        source = f"--schedule {args.schedule}"
    else:
        if args.every_s is None:
            raise ConfigError("every_s", None, "give --every-s T (mean seconds between failures) or --schedule FILE")
        seed = _seed(args.seed)
        schedule = draw_schedule(seed, args.every_s, job.duration_s, job.world_size)
        mtbf = args.every_s
        source = f"seed {seed}, one failure every {args.every_s:g}s on average (exponential)"
    if args.ckpt_every is not None and args.ckpt_every < 1:
        raise ConfigError("ckpt_every", args.ckpt_every, "must be >= 1 step")
    out = _out_dir(args.out, "goodput")
    print(f"ckptless-chaos goodput: {job.script} for {job.duration_s:g}s per system, W={job.world_size}; "
          f"{len(schedule)} SIGKILLs ({source}): " + ", ".join(f"{f.t:.1f}s r{f.rank}" for f in schedule), flush=True)
    load0 = os.getloadavg()
    t0 = time.monotonic()
    runs = compare(job, schedule, out, mtbf, args.ckpt_every, args.max_restarts,
                   log=lambda line: print(line, flush=True))
    ck, tr = runs["ckptless"], runs["torchrun"]
    print("\n" + render([ck, tr]), end="")
    ratio = ck.goodput / tr.goodput if tr.goodput > 0 else None
    print(f"ckptless / torchrun + DCP goodput: " + (f"{ratio:.2f}x" if ratio else "-") +
          f"; steps kept {ck.steps_kept} vs {tr.steps_kept}; checkpoint every {tr.extra.get('ckpt_every')} steps "
          f"({tr.extra.get('ckpt_every_source')}); wall {time.monotonic() - t0:.0f}s, 1-min load "
          f"{load0[0]:.1f} -> {os.getloadavg()[0]:.1f}; output {out}", flush=True)
    if args.json:
        doc = {"ckptless": ck.to_json(), "torchrun": tr.to_json(), "ratio": ratio,
               "schedule": [{"t": f.t, "rank": f.rank, "kind": f.kind} for f in schedule], "schedule_source": source,
               "world_size": job.world_size, "duration_s": job.duration_s, "mtbf_s": mtbf, "out": str(out),
               "load_1min": [load0[0], os.getloadavg()[0]]}
        Path(args.json).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.json}")
    return 1 if ck.ended.startswith("failed") else 0  # (a failed torchrun run is a measurement too)


def _demo_torchrun(faulty: JobRun, job: ScriptJob, out: Path) -> tuple[RunFigures, Path]:
    """The demo's measured baseline: the same job under plain torchrun + DCP, the same faults at the
    same times after launch (a node loss kills that node's ranks at once; a hang is a kill: torchrun has
    no hang detector, a frozen rank would hold every rank until the collective timeout)."""
    from ckptless.chaos.goodput import GoodputJob, calibrate, run_torchrun
    from ckptless.chaos.goodput_plan import TimedFault, young_daly_steps

    schedule = sorted((TimedFault(round(inj.t_monotonic - faulty.t0, 3), r) for inj in faulty.injections
                       for r in (inj.lost or inj.fault.targets)), key=lambda f: f.t)
    bound = max(300.0, 4 * faulty.wall_s)
    tj = GoodputJob(job.script, job.args, job.nnodes, job.nproc_per_node, 0, job.env, bound)
    print(f"\n== the same job under torchrun + DCP (--baseline torchrun): SIGKILL "
          + ", ".join(f"rank {f.rank} at {f.t:.1f}s" for f in schedule) + " after launch ==", flush=True)
    mtbf = faulty.wall_s / max(1, len(faulty.injections))
    save_s, step_s = calibrate(tj, out / "torchrun-calibration", 0.05, log=lambda line: print(line, flush=True),
                               seconds=30.0)
    every = young_daly_steps(save_s, mtbf, step_s)
    tr = run_torchrun(tj, schedule, out / "torchrun", every, len(schedule) + 1, log=lambda line: print(line, flush=True),
                      extra={"ckpt_every_source": f"Young/Daly: save {save_s:.2f}s, MTBF {mtbf:.0f}s"})
    return tr, out / "torchrun" / "goodput"


def _long(args: argparse.Namespace) -> int:
    """``run long [--seed S] [--faults N]``: the schedule first, then the run, the per-fault table,
    wall time and load average."""
    seed = _seed(args.seed if args.seed != "0" else str(LONG_SEED))
    sc = long_scenario(seed, args.faults or LongConfig.faults, LongConfig.spares if args.spares is None else args.spares)
    out = _out_dir(args.out, "long")
    spec = sc.spec
    print(f"ckptless-chaos long run, seed {seed}: {spec.nodes} nodes x {spec.nproc_per_node} workers + a spare node "
          f"with {spec.spares_per_spare_node} warm spares, {spec.steps} steps, --hang-timeout {spec.hang_timeout:g}; "
          f"output {out}", flush=True)
    for f, e in zip(sc.schedule.faults, sc.schedule.expect):
        print(f"  {f.describe()}  -> model: ranks {list(e.lost)} to {'/'.join(e.to)}", flush=True)
    t0 = time.monotonic()
    v = _run_all([sc], out)[0]
    print(render_table([v]), end="")
    print(render_fault_table(v), end="")
    load = ", ".join(f"{x:.1f}" for x in v.load)
    print(f"wall {time.monotonic() - t0:.0f}s (faulty run {v.faulty_s:.0f}s); 1-min load average {load} "
          f"(start, after each fault step, end); final generation {v.generation}", flush=True)
    return 0 if v.passed else 1


def _env_pairs(items: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError("env", item, "expected KEY=VALUE")
        env[key] = value
    return env


def _steps_list(text: str | None) -> list[int]:
    if not text:
        return []
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError("at", text, "expected step numbers, comma-separated") from None


def _run_script(args: argparse.Namespace, script_args: list[str]) -> int:
    spares = args.spares
    if spares is None:
        spares = args.nproc_per_node if args.name == "kill-node" else 0
    job = ScriptJob(Path(args.script).resolve(), tuple(script_args), nnodes=args.nnodes,
                    nproc_per_node=args.nproc_per_node, spares=spares, env=_env_pairs(args.env or []),
                    hang_timeout=args.hang_timeout)
    out = _out_dir(args.out, f"{args.name}-script")
    v = run_script(args.name, job, out, rank=args.rank, at=_steps_list(args.at), timeout_s=args.timeout,
                   log=lambda line: print(line, flush=True))
    print(render_details(v), end="")
    print(v.line, flush=True)
    return 0 if v.passed else 1


def _pick(names: str | None, seeds: str | None) -> list[Scenario]:
    cat = catalogue()
    chosen = list(cat.values())
    if names:
        wanted = [n.strip() for n in names.split(",") if n.strip()]
        for n in wanted:
            if n not in cat and n != "random":
                raise ConfigError("only", n, f"unknown scenario; one of {sorted(cat)}")
        chosen = [cat[n] for n in wanted if n in cat]
    for s in (seeds or "").split(","):
        if s.strip():
            chosen.append(random_scenario(_seed(s)))
    return chosen


def _seed(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError("seed", text, "must be an integer") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ckptless-chaos", description="fault injection for ckptless jobs")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="the fault-injected demo (what `make demo` runs)")
    d.add_argument("--out", help="output directory (default: a fresh temp dir)")
    d.add_argument("--steps", type=int, default=DEMO_STEPS, help=f"training steps (default {DEMO_STEPS})")
    d.add_argument("--baseline", choices=("torchrun",), default=None,
                   help="also run the demo job under plain torchrun + DCP with the same faults at the same "
                        "times, and show its measured row (else restart-from-disk is an ESTIMATE)")
    g = sub.add_parser("goodput", help="goodput of your script under ckptless and under torchrun + DCP, the same "
                                       "seeded failures, measured side by side",
                       usage="ckptless-chaos goodput --script PATH (--every-s T | --schedule FILE) --duration-s D "
                             "[...] [-- SCRIPT_ARGS...]")
    g.add_argument("--script", required=True, help="your training script (ckptless.init/protect/run or job.train); "
                                                   "its arguments after `--` ({out}: the run's dir); it must train "
                                                   "for at least --duration-s")
    g.add_argument("--every-s", type=float, default=None, help="mean seconds between failures (exponential)")
    g.add_argument("--schedule", default=None, help="a JSON schedule [{t, rank, kind}] instead of --every-s")
    g.add_argument("--duration-s", type=float, required=True, help="wall seconds each system runs")
    g.add_argument("--nnodes", type=int, default=2, help="ckptless agents (default 2); torchrun runs W on one")
    g.add_argument("--nproc-per-node", type=int, default=2, help="workers per node (default 2)")
    g.add_argument("--spares", type=int, default=0, help="ckptless warm spares on a spare-only node (default 0: "
                                                         "respawns)")
    g.add_argument("--ckpt-every", type=int, default=None,
                   help="torchrun's DCP checkpoint interval in steps (default: Young/Daly from a measured save)")
    g.add_argument("--max-restarts", type=int, default=None,
                   help="torchrun --max-restarts (default: the schedule's failures + 1)")
    g.add_argument("--seed", default="0", help="seed of the failure schedule (default 0)")
    g.add_argument("--env", action="append", metavar="KEY=VALUE", help="the script's environment (repeatable)")
    g.add_argument("--json", default=None, help="write both systems' figures as JSON")
    g.add_argument("--out", help="output directory")
    sub.add_parser("list", help="list the scenarios (for --script, and of the matrix)")
    r = sub.add_parser("run", help="run one scenario against its fault-free twin: on your script (--script) "
                                   "or on the matrix's demo job",
                       usage="ckptless-chaos run SCENARIO [--script PATH ...] [-- SCRIPT_ARGS...]")
    r.add_argument("name", help=f"with --script: one of {', '.join(SCRIPT_SCENARIOS)}; "
                                "else a matrix scenario (see `list`) or `random`")
    r.add_argument("--script", help="your training script (uses ckptless.init/protect/run or job.steps/guard "
                                    "and closes its job); its arguments go after `--` ({out}: the run's dir)")
    r.add_argument("--nnodes", type=int, default=2, help="agents (nodes) running workers (default 2)")
    r.add_argument("--nproc-per-node", type=int, default=2, help="workers per node (default 2)")
    r.add_argument("--spares", type=int, default=None,
                   help="warm spares on one extra spare-only node (default 0; kill-node: --nproc-per-node; "
                        f"`long`: {LongConfig.spares})")
    r.add_argument("--env", action="append", metavar="KEY=VALUE",
                   help="environment of the script in both runs (repeatable), e.g. its step count")
    r.add_argument("--rank", type=int, default=None, help="victim rank (default: the last rank)")
    r.add_argument("--at", metavar="STEP[,STEP]",
                   help="fault step(s) (default: 1/3 of the run; kill-node 1/2; kill-twice 1/3 and 2/3)")
    r.add_argument("--hang-timeout", type=float, default=None,
                   help=f"agents' --hang-timeout in the faulty run (default {DEFAULT_HANG_TIMEOUT_S:g} for "
                        "hang-worker, else off)")
    r.add_argument("--timeout", type=float, default=None,
                   help="seconds a run may take (default: 4x the fault-free run, >= 300)")
    r.add_argument("--seed", default="0", help=f"seed of `random` (default 0) or `long` (default {LONG_SEED}); "
                                               "matrix scenarios only")
    r.add_argument("--faults", type=int, default=None,
                   help=f"`long` only: number of faults (default {LongConfig.faults})")
    r.add_argument("--out", help="output directory")
    m = sub.add_parser("matrix", help="run the chaos matrix; non-zero exit if any scenario fails")
    m.add_argument("--only", help="comma-separated scenario names")
    m.add_argument("--seeds", help="also run `random` with these seeds (comma-separated)")
    m.add_argument("--out", help="output directory")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if "--" in argv:  # everything after the first `--` belongs to the user's script
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1:]
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 2
    if script_args and not ((args.command == "run" and args.script) or args.command == "goodput"):
        print("ckptless-chaos: error: arguments after `--` go to a --script", file=sys.stderr)
        return 2
    try:
        # gRPC's defaults for this process, before its etcd client starts gRPC. Inside the try: setting
        # one re-reads the CKPTLESS_* settings, and a bad one is bad input (exit 2), not a traceback.
        environment.set_default("GRPC_VERBOSITY", "ERROR")
        environment.set_default("GRPC_ENABLE_FORK_SUPPORT", "false")
        if args.command == "demo":
            return _demo(args)
        if args.command == "goodput":
            return _goodput(args, script_args)
        if args.command == "list":
            print("for `run SCENARIO --script PATH` (your script; steps are fractions of its run):")
            for ss in SCRIPT_SCENARIOS.values():
                print(f"  {ss.name:12} {ss.fault}  ->  {ss.expected}")
            print("the matrix (examples/train_demo.py, 2 nodes x 2 workers):")
            for sc in catalogue().values():
                print(f"  {sc.name:14} {sc.fault}  ->  {sc.expected}")
            print(f"  {'random':14} seeded kills/hangs (--seed S)")
            print(f"  {'long':14} {LongConfig.faults} seeded faults in one job: kills, hangs, node loss, leader loss, "
                  f"a kill during recovery (--seed S, --faults N)")
            return 0
        if args.command == "run" and args.script:
            return _run_script(args, script_args)
        if args.command == "run" and args.name == "long":
            return _long(args)
        if args.command == "run":
            scs = [random_scenario(_seed(args.seed))] if args.name == "random" else _pick(args.name, None)
            verdicts = _run_all(scs, _out_dir(args.out, args.name))
        else:
            verdicts = _run_all(_pick(args.only, args.seeds), _out_dir(args.out, "matrix"))
        print(render_table(verdicts), end="")
        return 0 if all(v.passed for v in verdicts) else 1
    except CkptlessError as exc:
        print(f"ckptless-chaos: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
