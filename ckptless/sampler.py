"""A rank's resumable, deterministic data position: :class:`ResumableSampler`.

Why: "bitwise identical after recovery" includes feeding the same samples in
the same order. A stock ``DataLoader`` iterator cannot be captured (its
position lives in worker processes and prefetch queues), so the position is
made explicit and tiny: ``{"epoch", "index"}``. The epoch's order is a pure
function of ``(seed, epoch)``, so a replacement process that never saw the
earlier epochs rebuilds the same order from those two numbers.

Sharding matches ``torch.utils.data.DistributedSampler``: the epoch
permutation is padded (by wrapping) or truncated (``drop_last``) to a multiple
of ``world_size`` and rank ``r`` takes every ``world_size``-th index from ``r``.

Why its own module: the position and the order it names are the whole of
what recovery restores; batching over it (:class:`ckptless.data.ResumableLoader`)
and wrapping a user's ``DataLoader`` (:func:`ckptless.data.resumable`) build
on it. Users import it as ``ckptless.data.ResumableSampler``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

from ckptless.errors import ConfigError, StateError

SEED_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads seeds so (seed, epoch) pairs don't collide
_SEEDINGS = ("mixed", "distributed")


def check_int(field: str, value: Any, low: int) -> int:
    """``value`` if it is an int >= ``low`` (a bool is not), else a ConfigError naming ``field``."""
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
    :class:`ckptless.data.ResumableLoader`, which counts consumed batches instead. Give
    that ``DataLoader`` its own ``generator=torch.Generator()``: otherwise
    each new DataLoader iterator draws a seed from the global torch RNG, and
    the iterator re-created after a restore shifts the global stream.

    ``seeding`` picks how ``(seed, epoch)`` seeds the epoch's permutation:
    ``"mixed"`` (default) spreads the pair so no two pairs alias;
    ``"distributed"`` seeds with ``seed + epoch`` exactly like
    ``DistributedSampler``, so the order equals
    ``DistributedSampler(shuffle=True, seed=seed)`` after ``set_epoch(epoch)``
    (and, like it, seed 1 epoch 0 is seed 0 epoch 1).
    """

    __ckptless_data_position__ = True

    def __init__(
        self,
        dataset_len: int,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle: bool = True,
        drop_last: bool = False,
        seeding: str = "mixed",
    ) -> None:
        self.dataset_len = check_int("dataset_len", dataset_len, 1)
        self.seed = check_int("seed", seed, 0)
        if seeding not in _SEEDINGS:
            raise ConfigError("seeding", seeding, f"must be one of {_SEEDINGS}")
        self.seeding = seeding
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.rank = 0
        self.world_size = 1
        self.epoch = 0
        self.index = 0
        # Not given: this process's rank and world (0 of 1 outside a distributed job). Taken from
        # ckptless's default group, so a pre-built spare's setup that leaves them out reads no rank
        # (and the sampler is re-ranked when the spare takes one).
        if rank is None or world_size is None:
            import torch.distributed as dist

            live = dist.is_available() and dist.is_initialized()
            rank = rank if rank is not None else (dist.get_rank() if live else 0)
            world_size = world_size if world_size is not None else (dist.get_world_size() if live else 1)
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
        check_int("world_size", world_size, 1)
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
            if self.seeding == "distributed":
                g.manual_seed(self.seed + epoch)  # DistributedSampler.__iter__, verbatim
            else:
                g.manual_seed((self.seed * SEED_MIX + epoch) % (1 << 63))
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
        self.epoch, self.index = check_int("epoch", epoch, 0), 0

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
