"""A resumable, deterministic data position.

Why: "bitwise identical after recovery" includes feeding the same samples in
the same order. A stock ``DataLoader`` iterator cannot be captured (its
position lives in worker processes and prefetch queues), so the position is
made explicit and tiny: ``{"epoch", "index"}``. The epoch's order is a pure
function of ``(seed, epoch)``, so a replacement process that never saw the
earlier epochs rebuilds the same order from those two numbers.

Sharding matches ``torch.utils.data.DistributedSampler``: the epoch
permutation is padded (by wrapping) or truncated (``drop_last``) to a multiple
of ``world_size`` and rank ``r`` takes every ``world_size``-th index from ``r``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from ckptless.errors import ConfigError, StateError

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads seeds so (seed, epoch) pairs don't collide


def _check_int(field: str, value: Any, low: int) -> int:
    if type(value) is not int or value < low:
        raise ConfigError(field, value, f"must be an int >= {low}")
    return value


class ResumableSampler(Sampler[int]):
    """Per-rank sampler whose position is ``{"epoch", "index"}``.

    ``index`` is how many of this rank's samples of ``epoch`` were handed out,
    i.e. the position of exactly the next sample. Iterating yields the rest of
    the current epoch and then rolls over to ``epoch + 1`` (no ``set_epoch``
    call needed, unlike ``DistributedSampler``); breaking off mid-epoch and
    iterating again continues where it stopped.

    Use with ``DataLoader(num_workers=0)``: worker processes prefetch, which
    advances the sampler ahead of what training consumed. With workers, use
    :class:`ResumableLoader`, which counts consumed batches instead. Give
    that ``DataLoader`` its own ``generator=torch.Generator()``: otherwise
    each new DataLoader iterator draws a seed from the global torch RNG, and
    the iterator re-created after a restore shifts the global stream.
    """

    def __init__(
        self,
        dataset_len: int,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle: bool = True,
        drop_last: bool = False,
    ) -> None:
        self.dataset_len = _check_int("dataset_len", dataset_len, 1)
        self.seed = _check_int("seed", seed, 0)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.rank = 0
        self.world_size = 1
        self.epoch = 0
        self.index = 0
        self.set_world(rank, world_size)

    # --- geometry ---------------------------------------------------------
    @property
    def num_samples(self) -> int:
        """Samples per rank per epoch."""
        n, w = self.dataset_len, self.world_size
        return n // w if self.drop_last else -(-n // w)

    def __len__(self) -> int:
        return self.num_samples

    def set_world(self, rank: int, world_size: int) -> None:
        """Take over ``rank`` of ``world_size`` (e.g. a replacement for a lost rank).

        Changing only the rank keeps the position: in lockstep data-parallel
        training every rank sits at the same ``index``. Changing the world
        size is allowed only at an epoch boundary (``index == 0``): mid-epoch
        the shards of the new world would not line up with what was consumed.
        """
        _check_int("world_size", world_size, 1)
        if type(rank) is not int or not 0 <= rank < world_size:
            raise ConfigError("rank", rank, f"must be an int in [0, {world_size})")
        if self.drop_last and self.dataset_len < world_size:
            raise ConfigError("world_size", world_size, f"exceeds dataset_len={self.dataset_len} with drop_last")
        if world_size != self.world_size and self.index != 0:
            raise ConfigError("world_size", world_size, f"can only change at an epoch boundary (index={self.index})")
        self.rank, self.world_size = rank, world_size

    def epoch_indices(self, epoch: int) -> list[int]:
        """This rank's dataset indices for ``epoch``, from ``(seed, epoch)`` only."""
        n = self.dataset_len
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed((self.seed * _MIX + epoch) % (1 << 63))
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        total = self.num_samples * self.world_size
        if total > n:
            reps = -(-total // n)
            order = (order * reps)[:total]
        else:
            order = order[:total]
        return order[self.rank : total : self.world_size]

    # --- iteration and state --------------------------------------------
    def _normalise(self) -> None:
        if self.index >= self.num_samples:
            self.epoch += 1
            self.index = 0

    def __iter__(self) -> Iterator[int]:
        self._normalise()
        epoch, indices = self.epoch, self.epoch_indices(self.epoch)
        for i in range(self.index, len(indices)):
            if self.epoch != epoch or self.index != i:
                return  # the position was changed under us (load_state_dict): stop
            self.index = i + 1  # advance before yielding: state always names the *next* sample
            yield indices[i]

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning (``DistributedSampler`` compatibility)."""
        self.epoch, self.index = _check_int("epoch", epoch, 0), 0

    def state_dict(self) -> dict[str, int]:
        self._normalise()
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.index = _parse_position(state, self.num_samples)


def _parse_position(state: Any, num_samples: int) -> tuple[int, int]:
    if not isinstance(state, dict) or set(state) != {"epoch", "index"}:
        raise StateError(f"data position must be {{'epoch', 'index'}}, got {state!r}")
    epoch, index = state["epoch"], state["index"]
    if type(epoch) is not int or type(index) is not int or epoch < 0 or not 0 <= index <= num_samples:
        raise StateError(f"data position {state!r} out of range (index must be in [0, {num_samples}])")
    return epoch, index


class ResumableLoader:
    """Batches over a :class:`ResumableSampler` whose position is what training consumed.

    The position advances when a batch is *returned*, not when it is fetched,
    so prefetching ``DataLoader`` workers (``num_workers > 0``) do not skew it.
    ``next_batch()`` crosses epoch boundaries by itself; after
    ``load_state_dict`` the next batch comes from the restored position (the
    internal iterator is rebuilt). A batch holds ``batch_size`` samples except
    the last of each epoch, which holds the remainder.
    """

    def __init__(
        self,
        dataset: Any,
        sampler: ResumableSampler,
        batch_size: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        if not isinstance(sampler, ResumableSampler):
            raise ConfigError("sampler", sampler, "must be a ResumableSampler")
        self.dataset = dataset
        self.sampler = sampler
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.num_workers = _check_int("num_workers", num_workers, 0)
        self.collate_fn = collate_fn
        self.pin_memory = pin_memory
        self._it: Iterator[Any] | None = None

    def __len__(self) -> int:
        """Batches per full epoch."""
        return -(-self.sampler.num_samples // self.batch_size)

    def _open(self) -> Iterator[Any]:
        s = self.sampler
        s._normalise()
        rest = s.epoch_indices(s.epoch)[s.index :]
        # A DataLoader iterator draws its workers' base seed from the *global*
        # torch RNG unless given a generator. Reopening mid-epoch after a
        # restore would then consume one extra global draw and shift every
        # later dropout mask; a private generator keyed by the position keeps
        # the global stream untouched and worker seeds reproducible.
        g = torch.Generator()
        g.manual_seed((s.seed * _MIX + s.epoch * 1_000_003 + s.index) % (1 << 63))
        loader = DataLoader(
            self.dataset,
            batch_size=self.batch_size,
            sampler=rest,
            collate_fn=self.collate_fn,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            generator=g,
        )
        return iter(loader)

    def next_batch(self) -> Any:
        """The batch at the current position; advances the position past it."""
        while True:
            if self._it is None:
                self._it = self._open()
            try:
                batch = next(self._it)
            except StopIteration:
                self._it = None
                self.sampler._normalise()
                continue
            s = self.sampler
            s.index = min(s.index + self.batch_size, s.num_samples)
            if s.index >= s.num_samples:
                s._normalise()
                self._it = None  # epoch done: the next call opens the next epoch
            return batch

    def __iter__(self) -> Iterator[Any]:
        """The remaining batches of the current epoch."""
        epoch = self.sampler.state_dict()["epoch"]
        while self.sampler.state_dict()["epoch"] == epoch:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
        self._it = None
