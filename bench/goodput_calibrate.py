"""Calibrate ``ckptless simulate`` on measured runs, then predict other runs before they are measured.

    .venv/bin/python bench/goodput_calibrate.py fit CALIB.json [...] --out calib.json
    .venv/bin/python bench/goodput_calibrate.py predict --calib calib.json --out PRED.json \\
        NAME:WORLD:NNODES:STATE_MIB:MTBF_S:DURATION_S:SEED ...
    .venv/bin/python bench/goodput_calibrate.py compare PRED.json MEASURED.json ...

``fit`` reads runs of ``bench/goodput_check.py`` and sets the two figures the model cannot take
from docs/benchmarks.md alone, on this machine as it is loaded now:

* ``mirror_fixed_s``: a mirrored step's cost beyond the capture copy, from the run's steady step
  minus its bare step (every step is mirrored);
* ``recovery_fixed_s``: the part of a recovery that does not grow with W, found by bisection so
  that the model, replaying the run's own kill times, gives the run's measured goodput;
* ``compute_s_per_mib``: the bare step's time beyond its sleep, per MiB of state (the AdamW update).

``predict`` runs the model (mean over 300 seeded schedules, with the 10th-90th percentiles) for
each validation configuration with those figures, and writes the predictions with a UTC
timestamp: the file exists before the measurement does. ``compare`` prints predicted vs measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataclasses import replace  # noqa: E402

from ckptless.simulate import Params, expected, simulate  # noqa: E402
from ckptless.simulate.model import mean_categories  # noqa: E402
from ckptless.simulate.failures import Failure  # noqa: E402

SLEEP_KEY = "step_s"


def _params(run: dict[str, Any], **kw: Any) -> Params:
    world, nnodes = int(run["world"]), int(run["nnodes"])
    return Params(world=world, nproc_per_node=world // nnodes, state_mib=float(run["state_mib"]),
                  mtbf_s=float(run["mtbf_s"]), duration_s=float(run["duration_s"]), mirror_every=1, replicas=1,
                  spares=int(run.get("spares", 0)), defer_in_recovery=True, **kw)


def fit_one(run: dict[str, Any]) -> dict[str, float]:
    p0 = _params(run, step_s=run["bare_step_s"])
    copy = p0.capture_blocking * p0.state_bytes / (p0.host_gbps * 1e9)
    mirror_fixed = max(0.0, run["steady_step_s"] - run["bare_step_s"] - copy)
    p_local = p0.nproc_per_node
    kills = [Failure(float(k["t"]), "software", int(k["rank"]) // p_local, int(k["rank"]) % p_local)
             for k in run["kills"]]
    lo, hi = 0.0, 20.0
    for _ in range(40):
        mid = (lo + hi) / 2
        p = _params(run, step_s=run["bare_step_s"], mirror_fixed_s=mirror_fixed, recovery_fixed_s=mid)
        g = simulate(p, 0, failures=kills)["ckptless"].goodput
        lo, hi = (mid, hi) if g > run["goodput"] else (lo, mid)
    return {"recovery_fixed_s": (lo + hi) / 2, "mirror_fixed_s": mirror_fixed,
            "compute_s_per_mib": max(0.0, run["bare_step_s"] - run[SLEEP_KEY]) / float(run["state_mib"]),
            "goodput": run["goodput"], "incidents": len(kills)}


def cmd_fit(a: argparse.Namespace) -> int:
    fits = [fit_one(json.loads(Path(f).read_text())) for f in a.runs]
    # the median over runs: one run made under a heavier load (the machine is shared) must not set the figure
    out = {k: statistics.median(f[k] for f in fits) for k in ("recovery_fixed_s", "mirror_fixed_s", "compute_s_per_mib")}
    out["runs"] = [str(f) for f in a.runs]
    out["per_run"] = fits
    out["fitted_at"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))
    return 0


def cmd_predict(a: argparse.Namespace) -> int:
    cal = json.loads(Path(a.calib).read_text())
    preds = []
    for spec in a.configs:
        name, world, nnodes, state, mtbf, dur, seed, *tool = spec.split(":")
        run = {"world": world, "nnodes": nnodes, "state_mib": state, "mtbf_s": mtbf, "duration_s": dur}
        step = a.step_sleep + cal["compute_s_per_mib"] * float(state)
        p = _params(run, step_s=step, recovery_fixed_s=cal["recovery_fixed_s"], mirror_fixed_s=cal["mirror_fixed_s"])
        x: dict[str, Any] = {"name": name, "world": int(world), "nnodes": int(nnodes), "state_mib": float(state),
                             "mtbf_s": float(mtbf), "duration_s": float(dur), "seed": int(seed), "step_s": step}
        if tool == ["goodrun"]:
            # ckptless-chaos goodput: wall from launch (startup is badput), the node-local tier on (a crashed
            # process's image outlives it), kills of survivors during a recovery not deferred, and its goodput
            # the ledger's (time inside kept steps: mirroring counts as productive there)
            q = replace(p, node_local=True, defer_in_recovery=False, startup_s=a.startup_s)
            cats = mean_categories(q, 300)["ckptless"]
            runs = [simulate(q, i)["ckptless"] for i in range(300)]
            led = sorted((r.seconds["productive"] + r.seconds["mirror"]) / q.duration_s for r in runs)
            x.update({"tool": "ckptless-chaos goodput", "startup_s": a.startup_s,
                      "predicted": (cats["productive"] + cats["mirror"]) / q.duration_s,
                      "p10": led[29], "p90": led[269]})
            t = replace(p, node_local=True, defer_in_recovery=False, startup_s=a.torchrun_startup_s)
            rs = sorted(simulate(t, i)["restart"].goodput for i in range(300))
            x.update({"torchrun_startup_s": a.torchrun_startup_s, "restart_predicted": statistics.fmean(rs),
                      "restart_p10": rs[29], "restart_p90": rs[269], "restart_ckpt_every_s": t.restart_interval_s})
        else:
            _, spread = expected(p, seeds=300)
            x.update({"predicted": spread["ckptless"].mean, "p10": spread["ckptless"].p10,
                      "p90": spread["ckptless"].p90, "restart_predicted": spread["restart"].mean,
                      "torchft_predicted": spread["torchft"].mean})
        preds.append(x)
    doc = {"predicted_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "calibration": cal, "predictions": preds}
    Path(a.out).write_text(json.dumps(doc, indent=1))
    for x in preds:
        print(f"{doc['predicted_at']} {x['name']}: W={x['world']} S={x['state_mib']:g} MiB MTBF={x['mtbf_s']:g}s "
              f"D={x['duration_s']:g}s -> ckptless goodput {x['predicted']:.3f} (p10-p90 {x['p10']:.3f}-{x['p90']:.3f})")
    return 0


def cmd_compare(a: argparse.Namespace) -> int:
    doc = json.loads(Path(a.pred).read_text())
    measured = {Path(m).stem: json.loads(Path(m).read_text()) for m in a.measured}
    print("| run | W | S MiB | MTBF s | D s | kills | predicted | p10-p90 | measured | abs diff | rel diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for x in doc["predictions"]:
        m = measured.get(x["name"])
        if m is None:
            continue
        if "ckptless" in m:  # a ckptless-chaos goodput --json: both systems
            tr = m["torchrun"]
            d = tr["goodput"] - x["restart_predicted"]
            print(f"| {x['name']} torchrun + DCP | {x['world']} | {x['state_mib']:g} | {x['mtbf_s']:g} | "
                  f"{x['duration_s']:g} | {tr.get('incidents')} | {x['restart_predicted']:.3f} | "
                  f"{x['restart_p10']:.3f}-{x['restart_p90']:.3f} | {tr['goodput']:.3f} | {d:+.3f} | "
                  f"{d / tr['goodput']:+.1%} |")
            m = m["ckptless"]
        d = m["goodput"] - x["predicted"]
        print(f"| {x['name']} | {x['world']} | {x['state_mib']:g} | {x['mtbf_s']:g} | {x['duration_s']:g} | "
              f"{m['incidents']} | {x['predicted']:.3f} | {x['p10']:.3f}-{x['p90']:.3f} | {m['goodput']:.3f} | "
              f"{d:+.3f} | {d / m['goodput']:+.1%} |")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit")
    f.add_argument("runs", nargs="+")
    f.add_argument("--out", required=True)
    pr = sub.add_parser("predict")
    pr.add_argument("--calib", required=True)
    pr.add_argument("--out", required=True)
    pr.add_argument("--step-sleep", type=float, default=0.2)
    pr.add_argument("--startup-s", type=float, default=10.0, help="ckptless launch -> first step (goodrun runs)")
    pr.add_argument("--torchrun-startup-s", type=float, default=7.0, help="torchrun launch -> first step")
    pr.add_argument("configs", nargs="+")
    c = sub.add_parser("compare")
    c.add_argument("pred")
    c.add_argument("measured", nargs="+")
    a = ap.parse_args()
    return {"fit": cmd_fit, "predict": cmd_predict, "compare": cmd_compare}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
