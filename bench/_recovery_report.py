"""The tables bench/recovery.py prints (docs/benchmarks.md quotes them): ckptless vs torchrun + DCP
per case and mode, both ends of a recovery, the torchrun restarts alone, and peak memory.

Why its own module: the runs produce plain records (:class:`~_recovery_ckptless.Recovery`,
:class:`~_recovery_torchrun.Restart`, memory rows); what a row shows and how cells are summarised
(min / median) is decided here only, so a table changes without touching a measurement.
"""

from __future__ import annotations

import statistics
from typing import Any

from _recovery_ckptless import MODE_LABELS, Recovery
from _recovery_common import MIB
from _recovery_torchrun import Restart


def _mm(xs: list[float]) -> str:
    if not xs:
        return "-"
    if len(xs) == 1:
        return f"{xs[0]:.2f}"
    return f"{min(xs):.2f} / {statistics.median(xs):.2f}"


def table(ck: list[Recovery], tr: list[Restart], bw: dict[int, float]) -> str:
    lines = [
        "| state/rank | world | mode | ckptless total s | detect | reform | repl. build | transfer | rollback | reprotect+step "
        "| repl. ready | torchrun+DCP cold s | torchrun+DCP warm s | torchrun cold / ckptless | reference s "
        "| ckptless / reference |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r.size, r.world) for r in ck} | {(r.size, r.world) for r in tr}, key=lambda k: (k[1], k[0]))
    for size, world in keys:
        cold = [r.total for r in tr if (r.size, r.world, r.cache) == (size, world, "cold")]
        warm = [r.total for r in tr if (r.size, r.world, r.cache) == (size, world, "warm")]
        for mode in (*MODE_LABELS.values(), "respawn (node-local)"):
            rs = [r for r in ck if (r.size, r.world, r.mode) == (size, world, mode)]
            if not rs:
                continue
            tot = [r.total for r in rs]
            refs = [r.detect + r.reform + size / bw[size] for r in rs]
            ratio_tr = f"{statistics.median(cold) / statistics.median(tot):.1f}x" if cold else "-"
            ratio_ref = statistics.median([r.total / f for r, f in zip(rs, refs)])
            lines.append(
                f"| {size // MIB} MiB | {world} | {mode} | {_mm(tot)} | {_mm([r.detect for r in rs])} "
                f"| {_mm([r.reform for r in rs])} | {_mm([r.phases['repl_build'] for r in rs])} | {_mm([r.phases.get('transfer_net', r.transfer - r.phases['repl_build']) for r in rs])} | {_mm([r.rollback for r in rs])} "
                f"| {_mm([r.reprotect_step for r in rs])} | {_mm([r.repl for r in rs])} | {_mm(cold)} | {_mm(warm)} "
                f"| {ratio_tr} | {_mm(refs)} | {ratio_ref:.2f}x |")
    return "\n".join(lines)


def resumed_table(ck: list[Recovery], tr: list[Restart]) -> str:
    """Both ends of a recovery, for both systems, measured the same way (one clock, same kill).

    resumed: t_kill -> every rank holds the resume state and starts its first step (ckptless: the
    last rollback_done; torchrun: the last rank's DCP load done). first step: -> the last rank's
    first step after the failure is done. The step itself (AdamW over S bytes, 4 ranks on the
    machine's cores) is in the second column for both.
    """
    lines = ["| state/rank | world | mode | ckptless resumed s | torchrun+DCP cold resumed s | ratio "
             "| ckptless first step done s | torchrun+DCP cold first step done s | ratio "
             "| first step's own duration: ckptless / ckptless steady step / torchrun s "
             "| unprotected window s (resumed -> re-protected) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    keys = sorted({(r.size, r.world) for r in ck}, key=lambda k: (k[1], k[0]))
    for size, world in keys:
        cold = [r for r in tr if (r.size, r.world, r.cache) == (size, world, "cold")]
        for mode in (*MODE_LABELS.values(), "respawn (node-local)"):
            rs = [r for r in ck if (r.size, r.world, r.mode) == (size, world, mode)]
            if not rs:
                continue
            res = [r.total - r.reprotect_step for r in rs]
            tot = [r.total for r in rs]
            t_res = [r.load for r in cold]
            t_tot = [r.total for r in cold]
            r1 = f"{statistics.median(t_res) / statistics.median(res):.1f}x" if cold else "-"
            r2 = f"{statistics.median(t_tot) / statistics.median(tot):.1f}x" if cold else "-"
            own = (f"{_mm([r.reprotect_step for r in rs])} / {_mm([r.phases.get('steady_step', float('nan')) for r in rs])}"
                   f" / {_mm([r.total - r.load for r in cold])}")
            window = _mm([r.phases.get("unprotected", float("nan")) for r in rs])
            lines.append(f"| {size // MIB} MiB | {world} | {mode} | {_mm(res)} | {_mm(t_res)} | {r1} "
                         f"| {_mm(tot)} | {_mm(t_tot)} | {r2} | {own} | {window} |")
    return "\n".join(lines)


def torchrun_table(tr: list[Restart]) -> str:
    lines = ["| state/rank | world | cache | kill -> all ranks init'd s | -> DCP loaded s | -> first step s "
             "| ckpt bytes cached at kill | DCP save s (inc 0) |", "|---|---|---|---|---|---|---|---|"]
    for r in tr:
        lines.append(f"| {r.size // MIB} MiB | {r.world} | {r.cache} | {r.restart:.2f} | {r.load:.2f} | {r.total:.2f} "
                     f"| {r.cached_bytes} | {r.save_s:.2f} |")
    return "\n".join(lines)


def memory_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| state/rank S | world | pool buffers | processes | peak RSS (max over ranks) | RSS before state "
             "| (peak - before) / S | target (2 + 2K) | shared mem |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['size'] // MIB} MiB | {r['world']} | {r['buffers']} | {r['processes']} "
                     f"| {r['peak_rss'] / 2**30:.2f} GiB | {r['base_rss'] / 2**20:.0f} MiB "
                     f"| {r['peak_over_base_in_S']:.2f} (by rank: {r['per_rank']}) | 4 | {r['shmem'] / 2**20:.0f} MiB |")
    return "\n".join(lines)
