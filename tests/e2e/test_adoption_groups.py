"""Any-rank adoption's group step, in a fresh process: an unbound default group is re-made under
the rank the spare takes (the old object then raises instead of answering locally), and refused
once the setup made a subgroup (its membership was decided by the standby rank). In a
subprocess: the default group is process-global state."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import torch
    import torch.distributed as dist
    from ckptless.errors import ConfigError
    from ckptless.worker import groups

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
    groups.ensure_default_group(store, 0, 4, 10)
    assert dist.get_rank() == 0 and groups.user_groups() == []
    kept = dist.group.WORLD  # a reference the setup kept: after the re-rank it must never answer locally
    groups.drop_default_group()
    groups.ensure_default_group(store, 2, 4, 10)
    assert (dist.get_rank(), dist.get_world_size()) == (2, 4), dist.get_rank()
    try:
        dist.all_reduce(torch.ones(2), group=kept)
    except Exception as exc:  # c10d may wrap ours (a ValueError whose context is the ConfigError)
        assert "standby rank" in f"{exc} {exc.__context__}", exc
    else:
        raise SystemExit("the retired default group answered a collective locally")
    sub = dist.new_group([0, 2])
    assert groups.user_groups(), "a subgroup made during setup is seen"
    try:
        groups.drop_default_group()
    except ConfigError as exc:
        print("refused:", exc)
    else:
        raise SystemExit("a default group with subgroups was dropped")
    assert dist.get_rank() == 2
    print("ok")
""")


def test_default_group_takes_another_rank_only_without_subgroups() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "refused:" in out.stdout and out.stdout.strip().endswith("ok")


def test_why_not_names_what_ties_the_spare_to_its_standby_rank() -> None:
    """Pure checks before an in-place adoption (no group made in this process)."""

    from ckptless.data import ResumableSampler
    from ckptless.recovery.decision import Assignment, RecoveryPlan
    from ckptless.recovery.wire import Membership
    from ckptless.state.registry import StateRegistry
    from ckptless.worker import rank_reads
    from ckptless.worker.adoption import why_not

    class ShardReader:  # user state that remembers the rank it read for, and cannot be told another
        def __init__(self, rank: int) -> None:
            self.rank = rank

        def state_dict(self) -> dict[str, int]:
            return {"pos": 0}

        def load_state_dict(self, state: dict[str, int]) -> None:
            pass

    plan = RecoveryPlan("j", 1, (Assignment(0, "a/w0", "a", "survivor"), Assignment(1, "s/spare0", "s", "spare")),
                        (1,), 3, (), (), True, (), 0, adopt_prebuilt=(1,))
    m = Membership(1, 2, "h", 1, plan.assignments, plan)
    ok = StateRegistry()
    ok.protect(data=ResumableSampler(8, seed=0, rank=0, world_size=2))  # ours: re-ranked by set_world
    # issue 35: a process not watched from its first line may have read its rank unseen
    assert "not watched from its first line" in (why_not(ok, m, 1) or "")
    assert rank_reads.at_process_start({"CKPTLESS_ROLE": "spare", "CKPTLESS_STANDBY_RANK": "0"})
    rank_reads.stop()  # as a spare's setup ends; its start was watched
    try:
        assert why_not(ok, m, 1) is None
        tied = StateRegistry()
        tied.protect(reader=ShardReader(0))
        assert "holds rank 0" in (why_not(tied, m, 1) or "")
        unplanned = Membership(1, 2, "h", 1, plan.assignments,
                               RecoveryPlan(**{**plan.__dict__, "adopt_prebuilt": ()}))
        assert "layout" in (why_not(ok, unplanned, 1) or "")
    finally:
        assert not rank_reads.at_process_start({})  # this test process is no spare
