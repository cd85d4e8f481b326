"""Resumable data position (ckptless.data)."""

from __future__ import annotations

from typing import Any

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


def test_loader_with_worker_process_keeps_consumed_position() -> None:
    ld = _loader(workers=1)
    first = ld.next_batch()[0].tolist()
    assert ld.state_dict() == {"epoch": 0, "index": 4}  # not advanced by prefetching
    assert first == ld.sampler.epoch_indices(0)[:4]


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
