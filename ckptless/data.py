"""Batches at a resumable, deterministic data position, and a stock ``DataLoader`` made resumable.

The position itself (``{"epoch", "index"}``, an epoch order that is a pure
function of ``(seed, epoch)``, sharded like ``DistributedSampler``) is
:class:`ResumableSampler` (:mod:`ckptless.sampler`; importable from here too).
:class:`ResumableLoader` batches over it and counts what training consumed.
:func:`resumable` turns an existing ``DataLoader`` into a
:class:`ResumableLoader` in one line, keeping its batches and order (with a
``DistributedSampler``: exactly its order, epoch by epoch).
:func:`protects_data_position` tells the job loop whether a registry holds
any data position at all.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)

from ckptless.errors import ConfigError
from ckptless.sample_seeds import SeedPerSample
from ckptless.sampler import SEED_MIX, ResumableSampler, check_int

if TYPE_CHECKING:
    from ckptless.state import StateRegistry

__all__ = ["DATA_POSITION_ATTR", "ResumableLoader", "ResumableSampler", "protects_data_position", "resumable",
           "set_world"]

DATA_POSITION_ATTR = "__ckptless_data_position__"
"""A protected object whose class (or instance) sets this to ``True`` declares
that it holds the data position; see :func:`protects_data_position`."""


class ResumableLoader:
    """Batches over a :class:`ResumableSampler` whose position is what training consumed.

    The position advances when a batch is *returned*, not when it is fetched,
    so prefetching ``DataLoader`` workers (``num_workers > 0``) do not skew it.
    ``next_batch()`` crosses epoch boundaries by itself; after
    ``load_state_dict`` the next batch comes from the restored position (the
    internal iterator is rebuilt). A batch holds ``batch_size`` samples except
    the last of each epoch, which holds the remainder, or is dropped with
    ``drop_last`` (as ``DataLoader(drop_last=True)`` does).

    Worker processes are started per epoch and after every restore. In a
    worker, the global torch, ``random`` and NumPy streams are seeded before
    each sample from ``(seed, epoch, sample index)`` (:mod:`ckptless.sample_seeds`): a
    random transform in a worker draws the same numbers for a sample whatever
    batch the loader was restored at, and whichever rank or worker loads it. A
    plain ``DataLoader``'s workers draw from a stream seeded once per pass, so a
    pass reopened mid-epoch draws other numbers. Without workers the batch
    loads in the training process, from its own streams, which the job
    protects.
    """

    __ckptless_data_position__ = True

    def __init__(
        self,
        dataset: Any,
        sampler: ResumableSampler,
        batch_size: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        prefetch_factor: int | None = None,
        pin_memory_device: str = "",
    ) -> None:
        if not isinstance(sampler, ResumableSampler):
            raise ConfigError("sampler", sampler, "must be a ResumableSampler")
        self.dataset = dataset
        self.sampler = sampler
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.num_workers = check_int("num_workers", num_workers, 0)
        self.collate_fn = collate_fn
        self.pin_memory = pin_memory
        self.drop_last = bool(drop_last)
        self._loader_kwargs: dict[str, Any] = {
            "timeout": timeout,
            "worker_init_fn": worker_init_fn,
            "multiprocessing_context": multiprocessing_context,
            "prefetch_factor": prefetch_factor,
        }
        if pin_memory_device:
            self._loader_kwargs["pin_memory_device"] = pin_memory_device
        self._it: Iterator[Any] | None = None
        # True while the position was last moved by an iterator of ``__iter__`` (not by next_batch,
        # a restore or set_epoch): a new ``iter()`` then starts the epoch again, as a DataLoader does.
        self._moved_by_iter = False
        self._check_nonempty()

    def __len__(self) -> int:
        """Batches per full epoch."""
        n = self.sampler.num_samples
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _check_nonempty(self) -> None:
        n = self.sampler.num_samples
        if self.drop_last and n < self.batch_size:
            raise ConfigError(
                "batch_size", self.batch_size,
                f"exceeds this rank's {n} samples per epoch with drop_last=True: every epoch would be empty",
            )

    def _settle(self) -> None:
        """Roll to the next epoch when nothing, or only a dropped short tail, is left of this one."""
        s = self.sampler
        if self.drop_last and s.num_samples - s.index < self.batch_size:
            s.index = s.num_samples
        s._normalise()

    def _open(self) -> Iterator[Any]:
        self._check_nonempty()  # the world size may have changed (set_world)
        self._settle()
        s = self.sampler
        rest = s.epoch_indices(s.epoch)[s.index :]
        if self.drop_last:
            rest = rest[: len(rest) // self.batch_size * self.batch_size]
        # A DataLoader iterator draws its workers' base seed from the *global*
        # torch RNG unless given a generator. Reopening mid-epoch after a
        # restore would then consume one extra global draw and shift every
        # later dropout mask; a private generator keyed by the position keeps
        # the global stream untouched and worker seeds reproducible.
        g = torch.Generator()
        g.manual_seed((s.seed * SEED_MIX + s.epoch * 1_000_003 + s.index) % (1 << 63))
        kwargs = dict(self._loader_kwargs)
        if self.num_workers > 0:  # each sample's worker-side randomness from the sample, not the worker's stream
            kwargs["worker_init_fn"] = SeedPerSample(kwargs["worker_init_fn"], s.seed, s.epoch)
        loader = DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            sampler=rest,
            collate_fn=self.collate_fn,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            generator=g,
            **kwargs,
        )
        return iter(loader)

    def next_batch(self) -> Any:
        """The batch at the current position; advances the position past it."""
        self._moved_by_iter = False
        return self._next()

    def _next(self) -> Any:
        while True:
            if self._it is None:
                self._it = self._open()
            try:
                batch = next(self._it)
            except StopIteration:
                self._it = None
                self._settle()
                continue
            s = self.sampler
            s.index = min(s.index + self.batch_size, s.num_samples)
            self._settle()
            if s.index == 0:
                self._it = None  # epoch done: the next call opens the next epoch
            return batch

    def __iter__(self) -> Iterator[Any]:
        """The batches of the current epoch, from the current position.

        Like a ``DataLoader``, every ``iter()`` starts the epoch again when an earlier iterator
        moved the position (``next(iter(loader))`` to probe a batch, a ``for`` left with
        ``break``): a probe consumes nothing. After a restore, ``next_batch()`` or ``set_epoch``,
        it continues from the position (the point of a resumable loader).
        """
        self._settle()
        if self._moved_by_iter and self.sampler.index > 0:
            self.sampler.index = 0
            self._it = None
        self._moved_by_iter = False
        return self._epoch(self.sampler.epoch)

    def _epoch(self, epoch: int) -> Iterator[Any]:
        while self.sampler.epoch == epoch:
            batch = self._next()
            self._moved_by_iter = True
            yield batch

    def set_epoch(self, epoch: int) -> None:
        """Go to the start of ``epoch``, unless already in it (then keep the position).

        ``DistributedSampler`` scripts call ``set_epoch(epoch)`` at the top of
        every epoch; keeping the position when the epoch is unchanged makes
        that call harmless after a mid-epoch restore.
        """
        self._settle()
        self._moved_by_iter = False
        if check_int("epoch", epoch, 0) != self.sampler.epoch:
            self.sampler.set_epoch(epoch)
            self._it = None

    def state_dict(self) -> dict[str, int]:
        self._settle()
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
        self._it = None
        self._moved_by_iter = False  # the next iter() continues from the restored position


# --- one-line wrapping of a stock DataLoader ------------------------------------------


def _agree(field: str, given: int | None, found: int) -> int:
    if given is not None and given != found:
        raise ConfigError(field, given, f"conflicts with the loader's DistributedSampler ({field}={found})")
    return found


def resumable(
    loader: DataLoader[Any],
    *,
    rank: int | None = None,
    world_size: int | None = None,
    seed: int | None = None,
) -> ResumableLoader:
    """A :class:`ResumableLoader` that yields what ``loader`` yields, and is ``Stateful``.

    ``job.protect(data=resumable(DataLoader(ds, batch_size=8, shuffle=True)))``
    then resumes bitwise exactly. Keeps the dataset, ``batch_size``,
    ``drop_last``, ``collate_fn``, ``num_workers``, ``pin_memory``, ``timeout``,
    ``worker_init_fn``, ``multiprocessing_context``, ``prefetch_factor``.

    The order of epoch ``e`` (the wrapper rolls epochs by itself):

    * ``DistributedSampler``: its own order after ``set_epoch(e)``, exactly
      (its rank, world size, seed, shuffle and drop_last are used; ``rank``,
      ``world_size``, ``seed`` given here must agree). Starts at its epoch.
    * ``shuffle=False`` (``SequentialSampler``): dataset order.
    * ``shuffle=True`` (``RandomSampler``): a plain loader draws each epoch's
      permutation from the global RNG, which no position can reproduce, so the
      order is *defined* as ``DistributedSampler(shuffle=True, seed=seed)``'s
      (``seed`` default 0); ``loader.generator`` is not used.

    Without a DistributedSampler the loader is not sharded (every rank sees
    the whole dataset, as the plain loader did) unless ``rank``/``world_size``
    are given, which shard it as a DistributedSampler would.

    Raises :class:`ConfigError` naming the field for what cannot be made
    exact: an ``IterableDataset`` or a dataset without ``len``, automatic
    batching off, a custom ``batch_sampler`` or ``sampler`` (including
    ``RandomSampler`` with replacement or ``num_samples``, and subclasses of
    the samplers above), ``in_order=False``.
    """
    if not isinstance(loader, DataLoader):
        raise ConfigError("loader", loader, "must be a torch.utils.data.DataLoader")
    ds = loader.dataset
    if isinstance(ds, IterableDataset):
        raise ConfigError(
            "dataset", type(ds).__name__,
            "is an IterableDataset: its position lives inside its iterator; use a map-style Dataset",
        )
    try:
        n = len(ds)  # type: ignore[arg-type]
    except TypeError as exc:
        raise ConfigError("dataset", type(ds).__name__, "has no len(): not a map-style dataset") from exc
    if loader.batch_size is None:
        if loader.batch_sampler is not None:
            raise ConfigError("batch_sampler", loader.batch_sampler, "a custom batch_sampler cannot be reproduced; pass batch_size")
        raise ConfigError("batch_size", None, "automatic batching is off (batch_size=None); not supported")
    if type(loader.batch_sampler) is not BatchSampler:
        raise ConfigError("batch_sampler", loader.batch_sampler, "a custom batch_sampler cannot be reproduced")
    if not getattr(loader, "in_order", True):
        raise ConfigError("in_order", False, "out-of-order batches depend on worker timing")
    sampler = loader.sampler
    epoch = 0
    if type(sampler) is DistributedSampler:
        if len(sampler.dataset) != n:  # type: ignore[arg-type]
            raise ConfigError("sampler", sampler, "is a DistributedSampler over a dataset of another length")
        rank = _agree("rank", rank, sampler.rank)
        world_size = _agree("world_size", world_size, sampler.num_replicas)
        seed = _agree("seed", seed, sampler.seed)
        shuffle, sample_drop, epoch = sampler.shuffle, sampler.drop_last, sampler.epoch
    elif type(sampler) in (SequentialSampler, RandomSampler):
        if len(sampler) != n:  # type: ignore[arg-type]
            raise ConfigError("sampler", sampler, "does not cover the dataset once")
        if isinstance(sampler, RandomSampler) and sampler.replacement:
            raise ConfigError("sampler", sampler, "RandomSampler with replacement cannot be reproduced")
        shuffle, sample_drop = type(sampler) is RandomSampler, False
    else:
        raise ConfigError(
            "sampler", sampler,
            "only SequentialSampler, RandomSampler and DistributedSampler orders can be reproduced;"
            " build a ResumableLoader with a ResumableSampler instead",
        )
    rs = ResumableSampler(
        n,
        seed=0 if seed is None else seed,
        rank=0 if rank is None else rank,
        world_size=1 if world_size is None else world_size,
        shuffle=shuffle,
        drop_last=sample_drop,
        seeding="distributed",
    )
    rs.set_epoch(check_int("epoch", epoch, 0))
    return ResumableLoader(
        ds,
        rs,
        loader.batch_size,
        collate_fn=loader.collate_fn,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
        drop_last=loader.drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        prefetch_factor=loader.prefetch_factor,
        pin_memory_device=loader.pin_memory_device,
    )


def set_world(obj: Any, rank: int, world_size: int) -> bool:
    """Tell a protected object (or its ``sampler``) that its data position reads ``rank`` of ``world_size``,
    when it can be told (``set_world``: ours can); False when it cannot. Used by a spare taking another
    rank as built (``worker/adoption.py``) and by a survivor hosting a lost rank (``worker/hosted.py``)."""
    for target in (obj, getattr(obj, "sampler", None)):
        fn = getattr(target, "set_world", None)
        if callable(fn):
            fn(rank, world_size)
            return True
    return False


def protects_data_position(registry: StateRegistry) -> bool:
    """Whether any protected object holds the data position.

    True for :class:`ResumableLoader` / :class:`ResumableSampler` (what
    :func:`resumable` returns included) and any object declaring
    ``__ckptless_data_position__ = True``, and any object of the user's own
    (not a module, optimizer, LR scheduler or grad scaler: a cursor, an
    iterator state) protected beside the model: that is what a script keeps
    its position in when it does not use ours (a false alarm on every worker
    otherwise). The job loop warns once when this is False: without a data
    position a recovered run feeds different batches.
    """
    import torch

    known = (torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)
    for name, obj in registry.items():
        declared = getattr(obj, DATA_POSITION_ATTR, None)
        if declared is not None:  # said either way: only True counts
            if declared is True:
                return True
            continue
        if name.startswith("_") or name in ("rng", "scaler") or isinstance(obj, known):
            continue
        if type(obj).__module__.split(".", 1)[0] not in ("torch", "ckptless"):
            return True  # the user's own Stateful: their data position, as far as anyone can tell
    return False
