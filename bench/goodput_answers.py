"""The numbers of docs/goodput.md's answer: each preset, three systems, as given and with the recommended
settings, and what moves them (one parameter changed at a time).

    .venv/bin/python bench/goodput_answers.py [--seeds 10] [--presets llama3-16k 100k meta-rsc]

Pure model runs (``ckptless.simulate``), no processes: a few seconds per preset.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckptless.simulate import Params, expected  # noqa: E402
from ckptless.simulate.presets import preset  # noqa: E402
from ckptless.simulate.recommend import recommend  # noqa: E402

WHAT_IFS = [
    ("communicators formed in O(1) per incident (comm_per_rank_s = 0)", {"comm_per_rank_s": 0.0}),
    ("the scheduler's node in 1 min instead of 10", {"replace_s": 60.0}),
    ("no spares, fewer ranks while waiting (lost_node = shrink)", {"spares": 0, "lost_node": "shrink"}),
    ("failures twice as often", "half_mtbf"),
    ("TorchFT's per-step quorum costs 2 % of a step", {"ft_overhead": 0.02}),
    ("TorchFT replica groups of 1,024 ranks (R = W / 1,024)", {"ft_group_ranks": 1024}),
    ("restart-from-disk without the 10-min requeue (restart in place)", {"requeue_s": 0.0}),
    ("restart-from-disk checkpointing every 30 min (not Young/Daly)", {"ckpt_every_s": 1800.0}),
    ("K = 2", {"replicas": 2}),
]


def row(label: str, p: Params, seeds: int) -> str:
    _, sp = expected(p, seeds=seeds)
    return (f"| {label} | {sp['ckptless'].mean:.1%} | {sp['restart'].mean:.1%} | {sp['torchft'].mean:.1%} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--presets", nargs="+", default=["llama3-16k", "100k", "meta-rsc"])
    a = ap.parse_args()
    for name in a.presets:
        p = preset(name)
        best, tried = recommend(p)
        tuned = replace(p, replicas=best.replicas, spares=best.spares, mirror_every=best.mirror_every,
                        snapshot_every_s=best.snapshot_every_s)
        print(f"\n### {name}: recommended K={best.replicas}, spares={best.spares}, mirror_every={best.mirror_every}, "
              f"snapshot every {best.snapshot_every_s:g} s; restart-from-disk checkpoints every "
              f"{tuned.restart_interval_s:.0f} s (Young/Daly); {len(tried)} settings tried\n")
        print("| setting | ckptless | restart-from-disk | TorchFT-style |")
        print("|---|---|---|---|")
        print(row("as the preset (no spares)", p, a.seeds))
        print(row(f"recommended ({best.spares} spares for every system)", tuned, a.seeds))
        for label, change in WHAT_IFS:
            q = replace(tuned, mtbf_s=tuned.mtbf_s / 2) if change == "half_mtbf" else replace(tuned, **change)
            print(row(label, q, a.seeds))
    return 0


if __name__ == "__main__":
    sys.exit(main())
