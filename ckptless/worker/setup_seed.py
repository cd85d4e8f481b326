"""Seed an unseeded script's global random streams before its setup, the same way in every incarnation.

Why: torch 2.13 seeds its default generator from entropy at import (older
torch used one fixed seed). A script that draws during its setup without
seeding (a dataset built with ``torch.rand``, a model initialised from the
global generator and then not fully restored) would build something else in a
replacement, which re-runs the setup: that rank would then train silently on
other data. ``ckptless.init()`` therefore seeds torch (every device), Python's
``random`` and NumPy's global ``RandomState`` with the job's seed when torch
was not seeded by the script, so every incarnation of every rank starts its
setup from the same streams, as torch before 2.13 did.

The seed is the same on every rank (``CKPTLESS_SEED``, default
:data:`DEFAULT_SEED`): a setup that draws from it builds the same objects on
every rank, so a pre-built spare's setup is the lost rank's too. A script that
wants per-rank streams seeds them itself (``torch.manual_seed(base + rank)``);
that reads the rank at setup, which binds a pre-built spare to its standby
rank (see :mod:`ckptless.worker.rank_reads`).

How "unseeded" is told: an entropy seed is a 64-bit draw, a seed a script
chooses is nearly always below 2**32 (NumPy accepts no more), so
``torch.initial_seed() >= 2**32`` means torch was not seeded by the script.
A script that seeds torch with a larger number is left as it is only if it
seeds after ``ckptless.init()``.
"""

from __future__ import annotations

import logging
import random
import numpy as np
import torch

from ckptless.environment import DEFAULT_SEED

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_SEED", "seed_if_unseeded", "script_seeded_torch"]
_ENTROPY_FLOOR = 2**32


def script_seeded_torch() -> bool:
    return torch.initial_seed() < _ENTROPY_FLOOR


def seed_if_unseeded(job_seed: int | None, announce: bool) -> int | None:
    """Seed torch, ``random`` and NumPy with the job's seed (``CKPTLESS_SEED``; None:
    :data:`DEFAULT_SEED`) unless the script seeded torch already.

    Returns the seed used (None: the script's own seeding is kept). ``announce``: say so (once per
    job: rank 0 of the first generation), since the script's setup now draws fixed numbers."""
    if script_seeded_torch():
        return None
    seed = DEFAULT_SEED if job_seed is None else job_seed
    torch.manual_seed(seed)  # every device's generator too
    random.seed(seed)
    np.random.seed(seed)
    if announce:
        log.warning("ckptless: the script does not seed torch before ckptless.init(); torch, random and numpy are "
                    "seeded with %d (CKPTLESS_SEED; the same on every rank and in every replacement), so a "
                    "replacement's setup draws what the original's did. Seed them yourself for other streams.", seed)
    return seed
