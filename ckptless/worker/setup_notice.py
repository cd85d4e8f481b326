"""What a spare will cost this job, said once at start by the spare pre-built as rank 0 (issue 38).

Why: nearly every real script reads its rank during its setup (a per-rank seed,
``master_process = rank == 0``, ``dist.get_rank()`` right after init). A pre-built
spare whose setup read its rank can take only its own standby rank as built; any
other lost rank restarts it as that rank, and the setup runs again on the
recovery's critical path, as for a warm respawn (issue 38 measured 2.92 s for
the spare against 3.02 s for a respawn). The user used to learn it from a line
logged at the failure, if at all. The spare knows all of it at the end of its
setup -- which reads, where, and how long each part of the setup took -- so it
says it then, before any failure: the spare pre-built as rank 0 (the agents give
their spares the lowest ranks no other spare covers, so one spare per job has
it; a refilled spare pre-built as rank 0 says it again).

The parts timed (``worker/rank_reads.py`` records them): the process's start (its
exec, or its fork from the agent's fork server) to ``ckptless.init()`` -- the
interpreter, the imports the fork server did not preload and the script's top
--, ``init()`` itself, and ``init()``'s return to ``job.run()``/``job.steps()`` --
the model's build, loaders, anything else the setup does. Pure: text from facts.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping, Sequence

WHERE_TO_READ = 'docs/benchmarks.md, "A spare for a setup that reads its rank"'
ALWAYS_PRELOADED = frozenset({"torch", "ckptless"})  # the fork server's own (launcher/forkserver_program.py)
WORTH_PRELOADING_S = 0.5  # below this, the imports before init() are not worth a line


def to_preload(imported: Iterable[str]) -> list[str]:
    """Of the top-level modules the script imported before ``init()``, those a warm restart imports
    again and ``CKPTLESS_PRELOAD`` could import once in the fork server: not the standard library's,
    not what the server always preloads, not private ones."""
    std: frozenset[str] = getattr(sys, "stdlib_module_names", frozenset())
    return sorted({m for m in imported if m not in std and m not in ALWAYS_PRELOADED and not m.startswith("_")
                   and m != "__main__"})


def says(prebuilt: bool, standby_rank: int | None) -> bool:
    """Whether this process gives the notice: once per job, by the spare pre-built as rank 0."""
    return prebuilt and standby_rank == 0


def parts(times: Mapping[str, float]) -> tuple[float, float, float] | None:
    """(before ``init()``, in it, after it up to the setup's end) in seconds; None if not all timed."""
    if not all(k in times for k in ("start", "init", "built", "end")):
        return None
    return (max(0.0, times["init"] - times["start"]), max(0.0, times["built"] - times["init"]),
            max(0.0, times["end"] - times["built"]))


def notice(reads: Sequence[str], times: Mapping[str, float], watched_from_start: bool,
           world_size: int, imported: Iterable[str] = ()) -> tuple[bool, str]:
    """(a warning?, the text): what a spare will cost this job and what to change."""
    p = parts(times)
    if p is None:
        took = "its setup's time was not measured"
    else:
        before, inside, after = p
        warm = " (forked from the agent's fork server, which had imported what it preloads)" \
            if times.get("warm") else ""
        took = (f"its setup took {before + inside + after:.2f} s here: {before:.2f} s from the process's start"
                f"{warm} to ckptless.init() (the interpreter, imports, the script's top), {inside:.2f} s in init(), "
                f"{after:.2f} s after it up to job.run()/job.steps() (the model's build, loaders, ...)")
    if not reads and watched_from_start:
        return False, (f"ckptless: this job's setup read no rank: a pre-built spare takes any lost rank with its "
                       f"objects as built (where their layouts match); {took}, kept off a recovery's critical path")
    if reads:
        more = f" and {len(reads) - 1} more" if len(reads) > 1 else ""
        why = f"this job's setup reads its rank ({reads[0]}{more})"
    else:
        why = ("this spare's setup was not watched from its first line (not started by ckptless-run with "
               "ckptless/worker/spare_site), so a rank read cannot be ruled out")
    before_init = int(times.get("reads_before_init", 0))
    after_only = bool(reads) and before_init == 0
    cost = (f"ckptless: {why}. A pre-built spare takes only the rank it was built as (1 of {world_size} ranks per "
            f"spare) with its objects as built; for any other lost rank it restarts as that rank and runs the whole "
            f"setup again on the recovery's critical path, as a warm respawn does: there it saves a respawn little "
            f"({WHERE_TO_READ}) while it holds one rank's memory. {took[0].upper()}{took[1:]}. ")
    fix = ("To make a spare worth having, leave the rank out of everything before job.run()/job.steps(): take it "
           "inside the training step (job.rank, dist.get_rank()), let ResumableSampler(n, seed) take it from the job, "
           "and let ckptless.init() seed an unseeded script the same on every rank; a spare then takes any rank as "
           "built.")
    if after_only and p is not None and p[0] >= WORTH_PRELOADING_S:
        # Measured (docs/benchmarks.md): with the part before init() preloaded, a waiting spare saves only its
        # process's start (0.3 s) and ties with a respawn; it is worth naming only when that part is slow.
        fix += (f" Every read came after ckptless.init(): with --no-spare-prebuild a spare waits in init() and, once "
                f"given its rank, skips the {p[0]:.2f} s before it (it still runs the {p[2]:.2f} s after it).")
    preload = to_preload(imported)
    if preload and p is not None and p[0] >= WORTH_PRELOADING_S:
        fix += (f" Either way a restart (this spare's, or any warm respawn) imports again what the agent's fork server "
                f"did not: CKPTLESS_PRELOAD={','.join(preload[:8])} imports them once, off the critical path (a module "
                f"that starts threads or CUDA at import is refused by the fork server, with a line, and respawns "
                f"then start cold).")
    return True, cost + fix
