"""Run one function as W spawned rank processes and collect what each wrote (bench/mirror.py, bench/replicas.py).

Each process gets ``(rank, store_path, out_path, *args)``: a FileStore path shared by the W ranks and
the JSON file its results go to. Spawned, not forked: each rank is a fresh interpreter, as a worker is.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any


def run_ranks(target: Callable[..., None], world: int, args: tuple[Any, ...], timeout: float) -> list[Any] | None:
    """Every rank's JSON result in rank order; None (and a line on stderr) when a rank failed or hung."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        outs = [os.path.join(tmp, f"r{r}.json") for r in range(world)]
        procs = [ctx.Process(target=target, args=(r, os.path.join(tmp, "store"), outs[r], *args))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        if any(p.is_alive() or p.exitcode for p in procs):
            for p in procs:
                if p.is_alive():
                    p.kill()
            print(f"bench worker failed or hung (world {world})", file=sys.stderr)
            return None
        per_rank = []
        for o in outs:
            with open(o) as f:
                per_rank.append(json.load(f))
        return per_rank
