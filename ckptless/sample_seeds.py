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

Persistent workers (issue 35) live across passes, so their base seed is one
for the whole job: keyed by it, a sample would get one transform for every
epoch. They read the pass's base from a shared-memory slot instead
(``shared``), which ``job.batches`` fills before each pass with a seed drawn
as a non-persistent loader's iterator draws its workers' base
(:func:`ckptless.passes.open_pass`); a reopened pass's one-pass workers get
that draw again, so they key every sample as the persistent workers did.
What a pass cannot be reopened from exactly is refused at start
(:func:`unreproducible`): persistent workers of a stateful loader (its own
resume), of an ``IterableDataset`` (no per-sample fetch to seed) and
without a batched fetch (``batch_size=None``).

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

from ckptless.errors import ConfigError
from ckptless.state import Stateful

__all__ = ["SeedPerSample", "install", "pass_seed_slot", "refuse_unreproducible", "sample_seed",
           "seed_global_streams", "seeds_per_pass", "unreproducible", "wants_seeds"]

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
    them. Not persistent workers (:func:`seeds_per_pass`: their base seed is theirs for every epoch,
    so keyed by it a sample would draw the same transform each epoch); nor ``batch_size=None`` (no
    batched fetch to take)."""
    return (isinstance(loader, DataLoader) and loader.num_workers > 0 and not loader.persistent_workers
            and loader.batch_sampler is not None and not isinstance(loader.dataset, IterableDataset))


def seeds_per_pass(loader: Any) -> bool:
    """A torch ``DataLoader`` (not a stateful one) whose persistent workers fetch map-style batches:
    seeded per sample from a base ``job.batches`` gives each pass (module doc)."""
    return (isinstance(loader, DataLoader) and loader.num_workers > 0 and loader.persistent_workers
            and loader.batch_sampler is not None and not isinstance(loader.dataset, IterableDataset)
            and not isinstance(loader, Stateful))


def unreproducible(loader: Any) -> str | None:
    """Why a pass over ``loader`` reopened after a recovery would load other samples than the original
    pass loaded (a random transform drawn in a worker), silently; None where ckptless reopens it
    exactly. Persistent workers only: their global streams carry over from every earlier pass, which
    no reopening can replay, unless seeded per pass (:func:`seeds_per_pass`)."""
    if not isinstance(loader, DataLoader) or loader.num_workers == 0 or not loader.persistent_workers \
            or seeds_per_pass(loader):
        return None
    if isinstance(loader.dataset, IterableDataset):
        return "an IterableDataset has no per-sample fetch to seed"
    if loader.batch_sampler is None:
        return "batch_size=None leaves no batched fetch to seed"
    return "its own resume restarts workers whose streams the original's had advanced over earlier epochs"


def refuse_unreproducible(loader: Any, name: str | None = None) -> None:
    """The one line a script gets at start for a loader whose workers a recovery cannot reproduce,
    instead of training on other random transforms after the first recovery (issue 35)."""
    why = unreproducible(loader)
    if why is None:
        return
    what = f"loader {name!r}" if name else "a loader"
    fix = ("pass persistent_workers=False" if not isinstance(loader, Stateful) else
           "pass persistent_workers=False, or iterate a torch DataLoader with job.batches")
    raise ConfigError("persistent_workers", True,
                      f"{what} ({type(loader).__name__} over {type(loader.dataset).__name__}) loads in persistent "
                      f"workers, whose random transforms a pass reopened after a recovery would not draw again: "
                      f"{why}; {fix}")


def install(loader: Any) -> None:
    """Seed ``loader``'s workers per sample from now on (idempotent; anything else is left alone).
    Before its first iterator: ``job.batches`` calls it at each pass, ``job.protect`` at once (a
    protected ``StatefulDataLoader`` starts its workers at its first ``state_dict()``)."""
    if wants_seeds(loader):
        loader.worker_init_fn = SeedPerSample.around(loader.worker_init_fn)
    elif seeds_per_pass(loader):
        loader.worker_init_fn = SeedPerSample.per_pass(loader.worker_init_fn)


def pass_seed_slot(loader: Any) -> torch.Tensor | None:
    """The shared slot a persistent loader's workers read each pass's base from (None: not such a loader)."""
    init = getattr(loader, "worker_init_fn", None)
    return init.shared if isinstance(init, SeedPerSample) and seeds_per_pass(loader) else None


class SeedPerSample:
    """A ``worker_init_fn``: the user's (``user``), then every fetch of the worker seeded per sample.

    ``seed``: the base of the seeds; ``None`` takes the pass's base seed from the worker
    (``WorkerInfo.seed - id``); a reopened pass gives the original pass's. ``epoch``: key by
    (seed, epoch, index) instead of by batch (module doc). ``shared``: persistent workers read the
    base from this one-element shared-memory tensor at each batch (filled before each pass)."""

    def __init__(self, user: Callable[[int], None] | None, seed: int | None = None,
                 epoch: int | None = None, shared: torch.Tensor | None = None) -> None:
        self.user, self.seed, self.epoch, self.shared = user, seed, epoch, shared

    @classmethod
    def around(cls, init: Callable[[int], None] | None) -> SeedPerSample:
        return init if isinstance(init, cls) else cls(init)

    @classmethod
    def per_pass(cls, init: Callable[[int], None] | None) -> SeedPerSample:
        """For persistent workers: the base from a shared slot, set before each pass."""
        if isinstance(init, cls) and init.shared is not None:
            return init
        user = init.user if isinstance(init, cls) else init
        return cls(user, shared=torch.zeros((), dtype=torch.int64).share_memory_())

    def __call__(self, worker_id: int) -> None:
        if self.user is not None:
            self.user(worker_id)
        info = get_worker_info()
        if info is None:
            return
        fixed = self.seed if self.seed is not None else info.seed - info.id
        epoch, dataset, shared = self.epoch, info.dataset, self.shared
        own = getattr(dataset, "__getitems__", None)
        batched = own if own and getattr(own, "__module__", None) != _TORCH_DELEGATES else None

        def seeds(indices: list[Any], first_only: bool = False) -> list[int]:
            base = int(shared) if shared is not None else fixed  # a persistent worker: this pass's base
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
