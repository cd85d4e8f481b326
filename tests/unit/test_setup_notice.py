"""ckptless.worker.setup_notice: what a spare will cost a job, said once at start (issue 38)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from ckptless.worker import setup_notice

TIMES = {"start": 10.0, "init": 11.5, "built": 11.6, "end": 13.6, "reads_before_init": 0.0, "warm": 1.0}


def test_only_the_spare_prebuilt_as_rank_0_says_it() -> None:
    assert setup_notice.says(True, 0)
    assert not setup_notice.says(True, 1)
    assert not setup_notice.says(False, 0)  # a member, a waiting spare
    assert not setup_notice.says(False, None)


def test_a_setup_that_reads_its_rank_is_told_where_how_long_and_what_to_change() -> None:
    warn, text = setup_notice.notice(["torch.distributed.get_rank() at /x/train.py:42",
                                      "os.environ['RANK'] at /x/train.py:50"], TIMES, True, 8)
    assert warn
    assert "reads its rank (torch.distributed.get_rank() at /x/train.py:42 and 1 more)" in text
    assert "1 of 8 ranks per spare" in text
    assert "Its setup took 3.60 s here: 1.50 s from the process's start (forked" in text
    assert "0.10 s in init(), 2.00 s after it" in text
    assert "leave the rank out of everything before job.run()" in text
    # every read after init(), 1.5 s before it: a waiting spare keeps that part, not the one after init()
    assert "--no-spare-prebuild" in text and "skips the 1.50 s before it (it still runs the 2.00 s after it)" in text
    quick = {**TIMES, "init": 10.1, "built": 10.2}  # 0.1 s before init(): a waiting spare ties with a respawn
    assert "--no-spare-prebuild" not in setup_notice.notice(["x at t.py:1"], quick, True, 4)[1]


def test_a_read_before_init_gets_no_waiting_spare_advice() -> None:
    warn, text = setup_notice.notice(["os.environ['RANK'] at t.py:3"], {**TIMES, "reads_before_init": 1.0}, True, 4)
    assert warn and "--no-spare-prebuild" not in text


def test_a_rank_agnostic_setup_is_an_info_line() -> None:
    warn, text = setup_notice.notice([], TIMES, True, 4)
    assert not warn and "read no rank" in text and "3.60 s" in text


def test_a_start_not_watched_is_a_warning_without_a_line() -> None:
    warn, text = setup_notice.notice([], {}, False, 4)
    assert warn and "not watched from its first line" in text and "not measured" in text


@given(st.dictionaries(st.sampled_from(["start", "init", "built", "end"]), st.floats(0, 1e6)))
def test_parts_are_never_negative_and_need_every_stamp(times: dict[str, float]) -> None:
    p = setup_notice.parts(times)
    assert (p is None) == (len(times) < 4)
    assert p is None or all(x >= 0 for x in p)


def test_imports_a_restart_repeats_are_named_for_the_fork_server() -> None:
    assert setup_notice.to_preload(["os", "json", "torch", "ckptless", "transformers", "_private", "numpy",
                                    "__main__"]) == ["numpy", "transformers"]
    warn, text = setup_notice.notice(["os.environ['RANK'] at t.py:3"], TIMES, True, 4, ["transformers", "os"])
    assert "CKPTLESS_PRELOAD=transformers " in text
    quick = {**TIMES, "init": 10.1}  # 0.1 s before init(): not worth a line
    assert "CKPTLESS_PRELOAD" not in setup_notice.notice(["x at t.py:1"], quick, True, 4, ["transformers"])[1]
