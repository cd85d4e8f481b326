"""Exact-point fault injection inside the library, active only under a chaos runner.

Why in the library: a fault "around step 5" or "while the leader publishes"
is a flaky test; the chaos runner needs the process itself to stop at an exact
point, say so, and wait (bounded) for the signal it is about to receive. With
``CKPTLESS_CHAOS_DIR`` unset (every normal run), :func:`pause_point` costs two
lookups and does nothing. Both variables are read through
:mod:`ckptless.environment`, when a point is first reached (and again after the
process's settings were re-read, e.g. a forked worker installing its own).

Protocol: ``CKPTLESS_CHAOS_POINTS`` lists ``tag=point`` items (comma
separated). When the process reaches ``point`` (e.g. ``step:r1:5`` -- rank 1
about to run step 5 -- or ``leader:before_publish``), it writes
``$CKPTLESS_CHAOS_DIR/paused_<tag>.json`` with its pid and the point, then
holds until ``release_<tag>`` exists (at most ``HOLD_S``). A tag fires once per
job (the marker is the latch, so a replacement does not pause again).
"""

from __future__ import annotations

import json
import os
import time

from ckptless import environment
from ckptless.environment import ProcessEnv

HOLD_S = 120.0
_points: tuple[ProcessEnv, dict[str, str]] | None = None  # parsed once per settings object
_announced: tuple[int, int] | None = None  # (pid, rank) this process last announced


def _load() -> dict[str, str]:
    global _points
    env = environment.current()
    if _points is None or _points[0] is not env:
        spec = env.chaos_points if env.chaos_dir else ""
        found: dict[str, str] = {}
        for item in filter(None, (x.strip() for x in spec.split(","))):
            tag, _, point = item.partition("=")
            if tag and point:
                found[point] = tag
        _points = (env, found)
    return _points[1]


def active() -> bool:
    return bool(_load())


def pause_point(point: str, **info: object) -> None:
    """Hold here if the chaos runner asked for ``point`` (no-op otherwise)."""
    points = _load()
    if not points:
        return
    tag = points.get(point)
    if tag is None:
        return
    d = environment.current().chaos_dir
    assert d is not None  # points are parsed only when it is set
    os.makedirs(d, exist_ok=True)
    marker = os.path.join(d, f"paused_{tag}.json")
    if os.path.exists(marker):
        return  # fired already (maybe in the process we replace)
    tmp = marker + f".{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"pid": os.getpid(), "point": point, "t_wall": time.time(), **info}, f)
    os.replace(tmp, marker)
    release = os.path.join(d, f"release_{tag}")
    deadline = time.monotonic() + HOLD_S
    while not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.005)  # held until the runner's signal (or its release file) arrives


def announce_rank(rank: int) -> None:
    """Say which process trains ``rank`` now: ``$CKPTLESS_CHAOS_DIR/rank<R>.json`` {pid, rank, t_wall}.

    Why: a runner that kills "a random rank every T seconds" (``ckptless-chaos goodput``) needs the
    process that trains a rank at that moment, under ckptless-run (a respawn, a spare that took the
    rank, a fork server's child, whose /proc environ says nothing) and under plain torchrun alike.
    Written once per (process, rank), atomically; a no-op (one tuple compare) outside chaos runs."""
    global _announced
    key = (os.getpid(), rank)
    if _announced == key:
        return
    _announced = key
    d = environment.current().chaos_dir
    if not d:
        return
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"rank{rank}.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"pid": os.getpid(), "rank": rank, "t_wall": time.time()}, f)
    os.replace(tmp, path)


def flip_point(point: str, registry: object, rank: int) -> None:
    """A chaos fault: silent data corruption. If the runner asked for ``point`` (e.g. ``flip:r2:5``: rank 2
    after its step 5, before that version is captured), flip the lowest bit of the first element of the
    first parameter of the first replicated module (a DDP model or a ``replicated_over`` declaration,
    :meth:`StateRegistry.replicated`, else an HSDP model) in place, as a faulty GPU or DIMM would, once per
    job (``flipped_<tag>.json`` is the latch). No-op otherwise."""
    points = _load()
    tag = points.get(point) if points else None
    if tag is None:
        return
    d = environment.current().chaos_dir
    assert d is not None
    marker = os.path.join(d, f"flipped_{tag}.json")
    if os.path.exists(marker):
        return
    import torch

    from ckptless.state import is_dtensor, local_of
    from ckptless.state import of_dtensors

    declared: dict[str, object] = getattr(registry, "replicated", dict)()
    items = list(getattr(registry, "items", lambda: iter(()))())
    names = [n for n, _ in items if n in declared] + [n for n, o in items if of_dtensors(o, rank) is not None]
    for name in names:
        module = dict(items)[name]
        for p in getattr(module, "parameters", lambda: iter(()))():
            local = local_of(p) if is_dtensor(p) else p.data
            if not local.numel():
                continue
            with torch.no_grad():
                low = local.reshape(-1)[:1].view(torch.uint8)[:1]  # little-endian: the lowest mantissa bit
                low ^= 1
            with open(marker, "w") as f:
                json.dump({"pid": os.getpid(), "point": point, "object": name, "t_wall": time.time()}, f)
            return
