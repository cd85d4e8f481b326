"""``ckptless simulate``'s flags: parsed into :class:`~ckptless.simulate.params.Params` (one ConfigError per bad value).

Why the flags arrive as strings: argparse would answer a bad number with its own usage line;
converting here gives the one error every other ckptless input gives, naming the field and
the value (``invalid world='x': not a number``), and the same validation as a preset or a
sweep (``Params.__post_init__``).
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from ckptless.errors import ConfigError
from ckptless.simulate.params import Params
from ckptless.simulate.presets import PRESETS, preset

#: flag -> Params field, for the flags every user needs (the rest: --set FIELD=VALUE)
FLAGS = {"world": "world", "nproc_per_node": "nproc_per_node", "step_s": "step_s", "state_mib": "state_mib",
         "mtbf_s": "mtbf_s", "duration_s": "duration_s", "spares": "spares", "replicas": "replicas",
         "mirror_every": "mirror_every", "placement": "placement", "snapshot_every_s": "snapshot_every_s",
         "lost_node": "lost_node", "replace_s": "replace_s", "ckpt_every_s": "ckpt_every_s"}


def add_arguments(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--preset", default="local", help=f"start from a named job: {', '.join(PRESETS)} (default local: "
                                                      "this machine, as bench/goodput_check.py runs)")
    sp.add_argument("--world", help="W: ranks that train")
    sp.add_argument("--nproc-per-node", help="P: ranks per node")
    sp.add_argument("--step-s", help="a bare training step, seconds")
    sp.add_argument("--state-mib", help="S: protected state per rank, MiB")
    sp.add_argument("--mtbf-s", help="the job's mean time between failures, seconds")
    sp.add_argument("--duration-s", help="simulated wall time, seconds")
    sp.add_argument("--spares", help="warm spare ranks (on spare nodes)")
    sp.add_argument("--replicas", help="K: peers holding each rank's mirror")
    sp.add_argument("--mirror-every", help="mirror every N steps")
    sp.add_argument("--placement", help="ring or group")
    sp.add_argument("--snapshot-every-s", help="ckptless's last-resort disk snapshot interval (0: none)")
    sp.add_argument("--lost-node", help="wait or shrink, when a lost device has no spare")
    sp.add_argument("--replace-s", help="the scheduler brings a replacement node, seconds")
    sp.add_argument("--ckpt-every-s", help="restart-from-disk's checkpoint interval (0: Young/Daly)")
    sp.add_argument("--mix", help="failure classes, e.g. software=0.13,accelerator=0.59,node=0.28")
    sp.add_argument("--defer-in-recovery", action="store_true",
                    help="a failure during a recovery lands once the job trains again (a chaos run's kills)")
    sp.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="any other model parameter (docs/goodput.md lists them), repeatable")
    sp.add_argument("--seed", default="0", help="first schedule's seed")
    sp.add_argument("--seeds", default="20", help="schedules to average over (1: one seeded run)")
    sp.add_argument("--no-recommend", action="store_true", help="skip the search for K, spares, mirror_every, snapshots")
    sp.add_argument("--json", metavar="FILE", help="also write the result as JSON")


def _convert(name: str, text: str) -> Any:
    kinds = {f.name: f.default for f in fields(Params)}
    if name not in kinds:
        raise ConfigError(name, text, "no such model parameter (docs/goodput.md lists them)")
    default = kinds[name]
    if isinstance(default, bool):
        if text.lower() in ("1", "true", "yes"):
            return True
        if text.lower() in ("0", "false", "no"):
            return False
        raise ConfigError(name, text, "must be true or false")
    if isinstance(default, str):
        return text
    try:
        return int(text) if isinstance(default, int) else float(text)
    except ValueError:
        raise ConfigError(name, text, "not a whole number" if isinstance(default, int) else "not a number") from None


def _int(name: str, text: str, low: int) -> int:
    try:
        v = int(text)
    except ValueError:
        raise ConfigError(name, text, "not a whole number") from None
    if v < low:
        raise ConfigError(name, v, f"must be >= {low}")
    return v


def params_from(args: argparse.Namespace) -> tuple[Params, int, int]:
    """(params, first seed, seeds) from the parsed flags."""
    over: dict[str, Any] = {}
    for flag, name in FLAGS.items():
        v = getattr(args, flag)
        if v is not None:
            over[name] = _convert(name, v)
    if args.mix:
        total = {"software": 0.0, "accelerator": 0.0, "node": 0.0}
        for part in args.mix.split(","):
            key, _, val = part.partition("=")
            if key.strip() not in total:
                raise ConfigError("mix", args.mix, f"unknown class {key.strip()!r} (software, accelerator, node)")
            total[key.strip()] = _convert("mix_" + key.strip(), val)
        over.update({"mix_" + k: v for k, v in total.items()})
    for item in args.set:
        key, eq, val = item.partition("=")
        if not eq:
            raise ConfigError("set", item, "expected FIELD=VALUE")
        over[key.strip()] = _convert(key.strip(), val.strip())
    if args.defer_in_recovery:
        over["defer_in_recovery"] = True
    return preset(args.preset, **over), _int("seed", args.seed, 0), _int("seeds", args.seeds, 1)
