"""Resumable data position (ckptless.data)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ckptless.data import ResumableLoader, ResumableSampler
from ckptless.errors import ConfigError, StateError


def take(it: Any, n: int) -> list[int]:
    return [next(it) for _ in range(n)]


def test_order_depends_only_on_seed_and_epoch() -> None:
    a = ResumableSampler(50, seed=3)
    torch.manual_seed(123)  # the global RNG plays no part
    b = ResumableSampler(50, seed=3)
    assert a.epoch_indices(0) == b.epoch_indices(0)
    assert a.epoch_indices(0) != a.epoch_indices(1)
    assert a.epoch_indices(0) != ResumableSampler(50, seed=4).epoch_indices(0)
    assert sorted(a.epoch_indices(2)) == list(range(50))
    # (seed, epoch) pairs do not alias the way seed + epoch would
    assert ResumableSampler(50, seed=1).epoch_indices(0) != ResumableSampler(50, seed=0).epoch_indices(1)


@pytest.mark.parametrize(("n", "world", "drop_last"), [(10, 3, False), (10, 3, True), (12, 4, False), (5, 2, True)])
def test_sharding_matches_distributed_sampler(n: int, world: int, drop_last: bool) -> None:
    for rank in range(world):
        ours = ResumableSampler(n, rank=rank, world_size=world, shuffle=False, drop_last=drop_last)
        ref = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=False, drop_last=drop_last)
        assert list(ours) == list(ref)
        assert len(ours) == len(ref)


def test_shards_partition_the_epoch() -> None:
    shards = [ResumableSampler(40, seed=1, rank=r, world_size=4).epoch_indices(0) for r in range(4)]
    flat = sorted(i for s in shards for i in s)
    assert flat == list(range(40))


def test_state_names_the_next_sample_and_resumes_mid_epoch() -> None:
    s = ResumableSampler(10, seed=9)
    full = s.epoch_indices(0) + s.epoch_indices(1)
    it = iter(s)
    first = take(it, 4)
    state = s.state_dict()
    assert state == {"epoch": 0, "index": 4}
    r = ResumableSampler(10, seed=9)
    r.load_state_dict(state)
    assert first + list(r) == full[:10]
    assert r.state_dict() == {"epoch": 1, "index": 0}  # rolled over at the end of the epoch
    assert list(r) == full[10:]


def test_iteration_continues_after_break_and_rolls_epochs() -> None:
    s = ResumableSampler(6, seed=0)
    seen: list[int] = []
    for i, idx in enumerate(s):
        seen.append(idx)
        if i == 2:
            break
    seen += list(s)
    seen += list(s)
    assert seen == s.epoch_indices(0) + s.epoch_indices(1)
    s.set_epoch(0)
    assert s.state_dict() == {"epoch": 0, "index": 0}


def test_load_state_dict_during_iteration_stops_old_iterator() -> None:
    s = ResumableSampler(8, seed=0)
    it = iter(s)
    take(it, 3)
    s.load_state_dict({"epoch": 0, "index": 1})
    assert list(it) == []
    assert list(s) == s.epoch_indices(0)[1:]


def test_sampler_with_plain_dataloader() -> None:
    ds = TensorDataset(torch.arange(10))
    s = ResumableSampler(10, seed=2)
    dl = DataLoader(ds, batch_size=3, sampler=s, generator=torch.Generator())
    it = iter(dl)
    b0 = next(it)[0].tolist()
    assert s.state_dict() == {"epoch": 0, "index": 3}
    assert b0 == s.epoch_indices(0)[:3]


def _loader(workers: int = 0) -> ResumableLoader:
    ds = TensorDataset(torch.arange(11))
    return ResumableLoader(ds, ResumableSampler(11, seed=4), batch_size=4, num_workers=workers)


def test_loader_position_counts_consumed_batches_across_epochs() -> None:
    ld = _loader()
    s = ld.sampler
    order = s.epoch_indices(0) + s.epoch_indices(1)
    got = [ld.next_batch()[0].tolist() for _ in range(5)]
    assert [x for b in got for x in b] == order[:4] + order[4:8] + order[8:11] + order[11:15] + order[15:19]
    assert ld.state_dict() == {"epoch": 1, "index": 8}
    assert len(ld) == 3


def test_loader_resume_is_exact_and_leaves_global_rng_alone() -> None:
    ref = _loader()
    want = [ref.next_batch()[0] for _ in range(7)]
    ld = _loader()
    got = [ld.next_batch()[0] for _ in range(2)]
    state = ld.state_dict()
    ld.next_batch()
    torch.manual_seed(0)
    before = torch.get_rng_state()
    ld.load_state_dict(state)
    got += [ld.next_batch()[0] for _ in range(5)]
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(a, b) for a, b in zip(want, got)) and len(got) == 7


def test_loader_iter_yields_rest_of_epoch() -> None:
    ld = _loader()
    ld.next_batch()
    assert [len(b[0]) for b in ld] == [4, 3]
    assert ld.state_dict() == {"epoch": 1, "index": 0}


def test_loader_iter_like_dataloader_probe_consumes_nothing() -> None:
    """``next(iter(loader))`` to probe the batch size (the DDP tutorial does) must not skip a batch:
    a new iter() starts the epoch again when an earlier iterator moved the position, as DataLoader."""
    ld, ref = _loader(), _loader()
    full = [b[0].tolist() for b in ref]
    probe = next(iter(ld))
    assert probe[0].tolist() == full[0]
    assert [b[0].tolist() for b in ld] == full  # the whole epoch, its first batch included
    assert ld.state_dict() == {"epoch": 1, "index": 0}
    for _ in ld:  # a for left with break, then a new for: the epoch again from its start
        break
    assert [b[0].tolist() for b in ld] == [b[0].tolist() for b in ref]
    # after a restore the next iter() continues from the restored position
    ld.load_state_dict({"epoch": 2, "index": 4})
    ref.load_state_dict({"epoch": 2, "index": 4})
    assert [b[0].tolist() for b in ld] == [b[0].tolist() for b in ref]


def test_loader_with_worker_process_keeps_consumed_position() -> None:
    ld = _loader(workers=1)
    first = ld.next_batch()[0].tolist()
    assert ld.state_dict() == {"epoch": 0, "index": 4}  # not advanced by prefetching
    assert first == ld.sampler.epoch_indices(0)[:4]


class _Augmented(torch.utils.data.Dataset):
    """A random transform drawn in the worker from its torch, ``random`` and NumPy streams."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        import random

        import numpy as np

        return torch.tensor([i * 1000 + int(torch.randint(0, 100, ())), random.randint(0, 99),
                             int(np.random.randint(0, 100))])


def _sees_its_own_dataset(worker_id: int) -> None:
    """A user's worker_init_fn that opens a file handle on its dataset: it must be given its own object."""
    info = torch.utils.data.get_worker_info()
    assert info is not None and isinstance(info.dataset, _Augmented), type(info.dataset)


def _augmented(workers: int) -> ResumableLoader:
    return ResumableLoader(_Augmented(), ResumableSampler(24, seed=4, world_size=2, rank=1), batch_size=3,
                           num_workers=workers, worker_init_fn=_sees_its_own_dataset)


def test_worker_transforms_draw_the_same_numbers_after_a_restore_at_any_batch() -> None:
    """Was: the workers' base seed came from the position at the reopening, so a loader restored mid-epoch
    gave every later sample other random transforms than the uninterrupted run (silently other data)."""
    ld = _augmented(workers=2)
    full = [ld.next_batch() for _ in range(10)]  # 4 batches an epoch: into the third epoch
    for k in (1, 3, 5, 6):
        other = _augmented(workers=2)
        for _ in range(k):
            other.next_batch()
        fresh = _augmented(workers=2)
        fresh.load_state_dict(other.state_dict())
        assert all(torch.equal(fresh.next_batch(), want) for want in full[k:k + 3]), f"restored at batch {k}"
    draws = torch.stack([b[:, 0] % 1000 for b in full]).reshape(-1)
    assert len(set(draws.tolist())) > len(draws) // 2  # independent per sample and epoch, not one draw repeated
    epoch0 = {int(r[0]) // 1000: r for b in full[:4] for r in b}
    epoch1 = {int(r[0]) // 1000: r for b in full[4:8] for r in b}
    both = epoch0.keys() & epoch1.keys()  # the rank's shard is reshuffled every epoch
    assert both and any(not torch.equal(epoch0[i], epoch1[i]) for i in both)  # a sample's transform changes by epoch


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"dataset_len": 0}, "dataset_len"),
        ({"dataset_len": 10, "seed": -1}, "seed"),
        ({"dataset_len": 10, "world_size": 0}, "world_size"),
        ({"dataset_len": 10, "rank": 2, "world_size": 2}, "rank"),
        ({"dataset_len": 10, "rank": 1.0, "world_size": 2}, "rank"),
        ({"dataset_len": 2, "world_size": 3, "drop_last": True}, "world_size"),
    ],
)
def test_bad_arguments_name_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        ResumableSampler(**kwargs)
    assert err.value.field == field


def test_loader_arguments_and_bad_state() -> None:
    with pytest.raises(ConfigError, match="batch_size"):
        ResumableLoader([], ResumableSampler(3), batch_size=0)
    with pytest.raises(ConfigError, match="sampler"):
        ResumableLoader([], object(), batch_size=1)  # type: ignore[arg-type]
    s = ResumableSampler(10)
    for bad in [{"epoch": 0}, {"epoch": -1, "index": 0}, {"epoch": 0, "index": 11}, {"epoch": 0, "index": 1.0}, [0, 0]]:
        with pytest.raises(StateError):
            s.load_state_dict(bad)  # type: ignore[arg-type]


def test_set_world_takes_over_rank_and_guards_world_change() -> None:
    s = ResumableSampler(20, seed=1, rank=0, world_size=4)
    s.load_state_dict({"epoch": 2, "index": 3})
    s.set_world(2, 4)  # a replacement taking over rank 2
    assert list(s) == ResumableSampler(20, seed=1, rank=2, world_size=4).epoch_indices(2)[3:]
    s.load_state_dict({"epoch": 2, "index": 3})
    with pytest.raises(ConfigError, match="epoch boundary"):
        s.set_world(0, 2)
    s.set_epoch(3)
    s.set_world(1, 2)
    assert len(s) == 10


# --- resumable(DataLoader): one-line wrapping (issue 10) ----------------------------------

from torch.utils.data import (  # noqa: E402
    BatchSampler,
    Dataset,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
)

from ckptless.data import protects_data_position, resumable  # noqa: E402
from ckptless.state import Capturer, StateRegistry, restore  # noqa: E402

N, WORLD, BS = 23, 3, 4


def _ds() -> TensorDataset:
    return TensorDataset(torch.arange(N, dtype=torch.float32) * 1.5, torch.arange(N) * 2)


def _assert_batches_equal(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert len(x) == len(y) and all(torch.equal(u, v) for u, v in zip(x, y))


def _dist_loader(ds: Any, rank: int, shuffle: bool, sample_drop: bool, batch_drop: bool, workers: int) -> DataLoader:
    s: DistributedSampler[Any] = DistributedSampler(ds, num_replicas=WORLD, rank=rank, shuffle=shuffle, seed=7, drop_last=sample_drop)
    return DataLoader(ds, batch_size=BS, sampler=s, drop_last=batch_drop, num_workers=workers)


def _reference(ds: Any, rank: int, shuffle: bool, sample_drop: bool, batch_drop: bool, workers: int, epochs: int = 2) -> list[Any]:
    """What a DistributedSampler script sees: set_epoch(e), then the whole loader, per epoch."""
    dl = _dist_loader(ds, rank, shuffle, sample_drop, batch_drop, workers)
    out: list[Any] = []
    for e in range(epochs):
        dl.sampler.set_epoch(e)  # type: ignore[attr-defined]
        out += list(dl)
    return out


CASES = [(True, False, False), (True, True, True), (False, False, True), (False, True, False)]


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(("shuffle", "sample_drop", "batch_drop"), CASES)
def test_resumable_iterates_like_dataloader_with_distributed_sampler(
    shuffle: bool, sample_drop: bool, batch_drop: bool, workers: int
) -> None:
    ds = _ds()
    for rank in range(WORLD) if workers == 0 else [1]:
        want = _reference(ds, rank, shuffle, sample_drop, batch_drop, workers)
        dl = _dist_loader(ds, rank, shuffle, sample_drop, batch_drop, workers)
        rl = resumable(dl)
        assert len(rl) == len(dl)
        got: list[Any] = []
        for e in range(2):
            rl.set_epoch(e)  # the script's own call stays harmless
            got += list(rl)
        _assert_batches_equal(want, got)
        assert rl.state_dict() == {"epoch": 2, "index": 0}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(("shuffle", "sample_drop", "batch_drop"), CASES)
def test_resumable_resumes_exactly_in_a_fresh_loader(shuffle: bool, sample_drop: bool, batch_drop: bool, workers: int) -> None:
    ds = _ds()
    want = _reference(ds, 2, shuffle, sample_drop, batch_drop, workers, epochs=3)
    per_epoch = len(_dist_loader(ds, 2, shuffle, sample_drop, batch_drop, workers))
    for k in sorted({1, per_epoch, per_epoch + 1}):
        a = resumable(_dist_loader(ds, 2, shuffle, sample_drop, batch_drop, workers))
        got = [a.next_batch() for _ in range(k)]
        state = a.state_dict()
        a.next_batch()  # work that will be rolled back
        b = resumable(_dist_loader(ds, 2, shuffle, sample_drop, batch_drop, workers))
        b.load_state_dict(state)
        got += [b.next_batch() for _ in range(len(want) - k)]
        _assert_batches_equal(want, got)


def test_resumable_through_capture_and_restore_and_global_rng_untouched() -> None:
    ds = _ds()
    want = _reference(ds, 0, True, False, False, 0, epochs=3)  # 2 batches per epoch
    reg = StateRegistry()
    reg.protect(data=resumable(_dist_loader(ds, 0, True, False, False, 0)))
    got = [reg["data"].next_batch() for _ in range(3)]  # type: ignore[attr-defined]
    img = Capturer(reg, "job", 0).capture(3, 0)
    fresh = StateRegistry()
    fresh.protect(data=resumable(_dist_loader(ds, 0, True, False, False, 0)))
    restore(fresh, img)
    before = torch.get_rng_state()
    got += list(fresh["data"]) + list(fresh["data"])  # type: ignore[call-overload]
    assert torch.equal(torch.get_rng_state(), before)
    _assert_batches_equal(want, got)


def test_resumable_shuffle_order_is_distributed_samplers_for_seed() -> None:
    ds = _ds()
    rl = resumable(DataLoader(ds, batch_size=BS, shuffle=True), seed=11)
    ref_s: DistributedSampler[Any] = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=11)
    ref = DataLoader(ds, batch_size=BS, sampler=ref_s)
    for e in range(2):
        ref_s.set_epoch(e)
        _assert_batches_equal(list(ref), list(rl))
    # explicit rank/world_size shard an unsharded loader like a DistributedSampler
    sharded = resumable(DataLoader(ds, batch_size=BS, shuffle=False, drop_last=True), rank=1, world_size=WORLD)
    _assert_batches_equal(list(DataLoader(ds, batch_size=BS, drop_last=True, sampler=DistributedSampler(
        ds, num_replicas=WORLD, rank=1, shuffle=False))), list(sharded))
    # plain sequential: the dataset order, unsharded, custom collate kept
    seq = resumable(DataLoader(ds, batch_size=5, collate_fn=lambda items: [int(y) for _, y in items]))
    assert [b for b in seq] == [[2 * i for i in range(j, min(j + 5, N))] for j in range(0, N, 5)]


def test_resumable_starts_at_the_samplers_epoch_and_set_epoch_semantics() -> None:
    ds = _ds()
    dl = _dist_loader(ds, 0, True, False, False, 0)
    dl.sampler.set_epoch(4)  # type: ignore[attr-defined]
    rl = resumable(dl)
    assert rl.state_dict() == {"epoch": 4, "index": 0}
    rl.next_batch()
    rl.set_epoch(4)  # same epoch: position kept
    assert rl.state_dict() == {"epoch": 4, "index": BS}
    rl.set_epoch(6)
    assert rl.state_dict() == {"epoch": 6, "index": 0}


class _Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(4))


class _NoLen(Dataset[int]):
    def __getitem__(self, i: int) -> int:
        return i


class _MySampler(DistributedSampler[Any]):
    pass


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda ds: DataLoader(_Stream(), batch_size=2), "dataset"),
        (lambda ds: DataLoader(_NoLen(), batch_size=2), "dataset"),
        (lambda ds: DataLoader(ds, batch_sampler=BatchSampler(SequentialSampler(ds), 3, False)), "batch_sampler"),
        (lambda ds: DataLoader(ds, batch_size=None), "batch_size"),
        (lambda ds: DataLoader(ds, batch_size=2, sampler=SubsetRandomSampler(range(5))), "sampler"),
        (lambda ds: DataLoader(ds, batch_size=2, sampler=RandomSampler(ds, replacement=True)), "sampler"),
        (lambda ds: DataLoader(ds, batch_size=2, sampler=RandomSampler(ds, num_samples=5)), "sampler"),
        (lambda ds: DataLoader(ds, batch_size=2, sampler=_MySampler(ds, num_replicas=2, rank=0)), "sampler"),
        (lambda ds: DataLoader(ds, batch_size=2, num_workers=1, in_order=False), "in_order"),
        (lambda ds: DataLoader(ds, batch_size=9, drop_last=True, sampler=DistributedSampler(ds, 3, 0)), "batch_size"),
        (lambda ds: list(ds), "loader"),
    ],
    ids=["iterable", "no_len", "batch_sampler", "no_batching", "subset_sampler", "replacement", "num_samples",
         "sampler_subclass", "out_of_order", "empty_epochs", "not_a_loader"],
)
def test_resumable_refuses_what_cannot_be_exact(make: Callable[[Any], Any], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        resumable(make(_ds()))
    assert err.value.field == field


def test_resumable_rejects_conflicting_world() -> None:
    dl = _dist_loader(_ds(), 1, True, False, False, 0)
    assert resumable(dl, rank=1, world_size=WORLD, seed=7).sampler.rank == 1
    for kwargs, field in [({"rank": 0}, "rank"), ({"world_size": 2}, "world_size"), ({"seed": 8}, "seed")]:
        with pytest.raises(ConfigError) as err:
            resumable(dl, **kwargs)
        assert err.value.field == field


def test_protects_data_position() -> None:
    class Declared:
        __ckptless_data_position__ = True

        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, s: dict[str, Any]) -> None:
            pass

    class Anything(Declared):
        __ckptless_data_position__ = "yes"  # type: ignore[assignment]  # only True counts

    reg = StateRegistry()
    reg.protect(model=torch.nn.Linear(2, 2))
    assert not protects_data_position(reg)
    reg.protect(other=Anything())
    assert not protects_data_position(reg)
    class Cursor:  # the script's own position keeper (no declaration): counts
        def state_dict(self) -> dict[str, Any]:
            return {"i": 0}

        def load_state_dict(self, s: dict[str, Any]) -> None:
            pass

    sched_only = StateRegistry()
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    sched_only.protect(model=torch.nn.Linear(2, 2), optimizer=opt,
                       scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))
    assert not protects_data_position(sched_only)
    for obj in (Declared(), ResumableSampler(4), resumable(DataLoader(_ds(), batch_size=2)), Cursor()):
        r = StateRegistry()
        r.protect(data=obj)
        assert protects_data_position(r)


def test_sampler_seeding_distributed_matches_and_is_validated() -> None:
    s = ResumableSampler(N, seed=3, seeding="distributed")
    ref: DistributedSampler[int] = DistributedSampler(_ds(), num_replicas=1, rank=0, shuffle=True, seed=3)
    ref.set_epoch(2)
    assert s.epoch_indices(2) == list(ref)
    with pytest.raises(ConfigError) as err:
        ResumableSampler(N, seeding="torch")
    assert err.value.field == "seeding"
