"""ckptless.worker.rank_reads: which of a pre-built spare's setup reads name its rank (issue 17)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from ckptless.worker import rank_reads


@pytest.fixture
def watch(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    rank_reads.start()
    try:
        yield
    finally:
        rank_reads.stop()


def test_the_scripts_own_reads_are_named_with_their_line(watch: None) -> None:
    assert int(os.environ["RANK"]) == 3
    assert os.environ.get("LOCAL_RANK") == "1"
    assert os.environ.get("PATH") is not None  # not a rank variable
    reads = rank_reads.reads()
    assert len(reads) == 2 and all("test_rank_reads.py:" in r for r in reads), reads
    assert reads[0].startswith("os.environ['RANK'] at") and reads[1].startswith("os.environ['LOCAL_RANK'] at")


def test_get_rank_is_watched_and_still_answers(watch: None) -> None:
    with pytest.raises((ValueError, RuntimeError)):  # no default group here: torch's own answer, unchanged
        dist.get_rank()
    assert [r.split(" at ")[0] for r in rank_reads.reads()] == ["torch.distributed.get_rank()"]


def test_whole_environment_copies_and_library_reads_are_not_the_scripts(watch: None) -> None:
    subprocess.run(["true"], check=True)  # subprocess copies the environment for the child
    os.environ.copy()
    from ckptless.data import ResumableSampler

    ResumableSampler(8, seed=1)  # takes rank and world from the job (ckptless's own read)
    assert rank_reads.reads() == []


def test_stop_restores_what_it_replaced() -> None:
    before_class, before_get_rank = os.environ.__class__, dist.get_rank
    rank_reads.start()
    assert os.environ.__class__ is not before_class and dist.get_rank is not before_get_rank
    rank_reads.stop()
    assert os.environ.__class__ is before_class and dist.get_rank is before_get_rank
    os.environ.get("RANK")
    assert rank_reads.reads() == []  # nothing recorded once stopped
