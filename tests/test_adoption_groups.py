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
