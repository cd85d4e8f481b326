"""Random transforms in loader workers that do not depend on what a worker loaded before.

Why: a DataLoader worker's global streams (torch CPU, ``random``, NumPy) are
seeded once per pass and advance with every sample it loads, so the numbers
a random crop draws at batch k depend on everything that worker loaded
before it. A pass reopened at k (after a rollback, or in a replacement)
starts new workers, which draw other numbers: the job would silently train
on other samples than the run without the failure. Seeded before each
sample from where the sample sits, the transform depends on nothing else.

How: :class:`SeedPerSample` is the loader's ``worker_init_fn``; after the
user's own, it gives the worker's copy of the dataset an instance attribute
``__getitems__``, which torch's map-style fetcher calls with each batch's
indices when the dataset has one (the user's object in the training
process is untouched). Two keys:

* by batch (``epoch is None``: ``job.batches`` over a DataLoader): sample
  ``j`` of a batch is seeded from (the pass's base seed, the batch's
  indices, ``j``). The batches of a reopened pass are the original's, so the
  seeds are too, and an index drawn twice in a pass (sampling with
  replacement, padding) gets two transforms unless two whole batches are
  the same.
* by sample (``epoch`` given: :class:`ckptless.data.ResumableLoader`): from
  (the loader's seed, the epoch, the sample's index), so a transform is the
  same whichever rank or micro-batch loads the sample (``set_world``).

Cost: ~10 us a sample, in the workers (``bench/loader_seeding.py``: 1.0-1.3x the
plain loader's pass on a light 35-49 us sample, on 2 shared cores).
"""

from __future__ import annotations

import logging
import operator
import random
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

__all__ = ["SeedPerSample", "install", "sample_seed", "seed_global_streams", "wants_seeds"]

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1
_TORCH_DELEGATES = "torch.utils.data.dataset"  # Subset, StackDataset: a __getitems__ that calls __getitem__


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed from three numbers (SplitMix64's finaliser): distinct for every triple in practice,
    so transforms stay independent across samples, epochs and ranks."""
    z = (seed * 0x9E3779B97F4A7C15 + epoch * 1_000_003 + index * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def seed_global_streams(seed: int) -> None:
    """Seed the process's global torch CPU, ``random`` and NumPy streams (~8 us; ``torch.manual_seed``
    costs 110 us, seeding every device type too)."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % (1 << 32))


def as_int(key: Any) -> int:
    """A sampler's key as a number, the same in every process (an index; else its text's CRC-32)."""
    try:
        return operator.index(key)
    except TypeError:
        return zlib.crc32(repr(key).encode())


def _batch_key(indices: list[Any]) -> int:
    return zlib.crc32(np.asarray([as_int(i) for i in indices], dtype=np.int64).tobytes())


def wants_seeds(loader: Any) -> bool:
    """A map-style DataLoader (or ``StatefulDataLoader``) whose passes load in workers started for
    them. Not with persistent workers: a pass's base seed is theirs for every epoch, so a sample
    would draw the same transform each epoch; nor ``batch_size=None`` (no batched fetch to take)."""
    return (isinstance(loader, DataLoader) and loader.num_workers > 0 and not loader.persistent_workers
            and loader.batch_sampler is not None and not isinstance(loader.dataset, IterableDataset))


def install(loader: Any) -> None:
    """Seed ``loader``'s workers per sample from now on (idempotent; anything else is left alone).
    Before its first iterator: ``job.batches`` calls it at each pass, ``job.protect`` at once (a
    protected ``StatefulDataLoader`` starts its workers at its first ``state_dict()``)."""
    if wants_seeds(loader):
        loader.worker_init_fn = SeedPerSample.around(loader.worker_init_fn)


class SeedPerSample:
    """A ``worker_init_fn``: the user's (``user``), then every fetch of the worker seeded per sample.

    ``seed``: the base of the seeds; ``None`` takes the pass's base seed from the worker
    (``WorkerInfo.seed - id``); a reopened pass gives the original pass's. ``epoch``: key by
    (seed, epoch, index) instead of by batch (module doc)."""

    def __init__(self, user: Callable[[int], None] | None, seed: int | None = None,
                 epoch: int | None = None) -> None:
        self.user, self.seed, self.epoch = user, seed, epoch

    @classmethod
    def around(cls, init: Callable[[int], None] | None) -> SeedPerSample:
        return init if isinstance(init, cls) else cls(init)

    def __call__(self, worker_id: int) -> None:
        if self.user is not None:
            self.user(worker_id)
        info = get_worker_info()
        if info is None:
            return
        base = self.seed if self.seed is not None else info.seed - info.id
        epoch, dataset = self.epoch, info.dataset
        own = getattr(dataset, "__getitems__", None)
        batched = own if own and getattr(own, "__module__", None) != _TORCH_DELEGATES else None

        def seeds(indices: list[Any], first_only: bool = False) -> list[int]:
            if epoch is not None:
                return [sample_seed(base, epoch, as_int(i)) for i in indices[:1 if first_only else None]]
            key = _batch_key(indices)  # once a batch
            return [sample_seed(base, key, j) for j in range(1 if first_only else len(indices))]

        def getitems(indices: list[Any]) -> Any:
            if batched:  # the user's own batched fetch: seeded once, as its first sample
                seed_global_streams(seeds(indices, first_only=True)[0])
                return batched(indices)
            out = []
            for seed, i in zip(seeds(indices), indices):
                seed_global_streams(seed)
                out.append(dataset[i])
            return out

        try:
            setattr(dataset, "__getitems__", getitems)  # noqa: B010 - an instance attribute, on purpose
        except Exception as exc:  # noqa: BLE001 - __slots__, a frozen model: the worker's own streams then
            log.warning("loader worker %d: random transforms are not seeded per sample (%s: %s); a pass "
                        "reopened mid-way draws other numbers in its workers", worker_id, type(exc).__name__, exc)
