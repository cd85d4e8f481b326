"""Every private or version-dependent torch attribute ckptless touches exists on the torch under test
(tests/harness/torch_touchpoints.py; docs/compatibility.md's inventory).

Why: these are the places a torch release breaks ckptless without a deprecation cycle, and most of them
act only in a recovery (a restore, a re-formation), where a missing attribute is an AttributeError in the
middle of an incident. CI runs this on torch 2.13.0 and ``make test-compat`` on 2.14.1, so a rename
fails here, named, before any job meets it. A CPU build cannot show ProcessGroupNCCL's (``n/a``).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from ..harness.repo import REPO
from ..harness.torch_touchpoints import TOUCHPOINTS, Touchpoint


@pytest.mark.parametrize("touchpoint", TOUCHPOINTS, ids=lambda t: t.where())
def test_touchpoint_exists_on_this_torch(touchpoint: Touchpoint) -> None:
    got = touchpoint.probe()
    assert not got.startswith("no"), f"{touchpoint.where()}: {touchpoint.what}: {got}"


def test_every_touchpoint_names_a_line_of_the_product() -> None:
    """The inventory follows the code: a touchpoint whose line is gone is a stale row."""
    stale = [t.where() for t in TOUCHPOINTS if t.where().endswith("not found)")]
    assert not stale, stale


def test_a_group_ckptless_builds_writes_no_torch_deprecation_warning() -> None:
    """torch 2.14 made ``_set_sequence_number_for_group`` a no-op that writes a deprecation warning to the
    stderr of every process calling it (once per process, from C++): each worker's log. ckptless calls it
    only where torch's own group creation does (worker/nccl.py). In a fresh process, since the warning is
    written once per process and this test must see the first one."""
    code = ("import torch.distributed as dist; from datetime import timedelta; "
            "from ckptless.worker import rebindable; "
            "rebindable.new_user_gloo(dist.HashStore(), 1, 0, 1, timedelta(seconds=10))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "deprecated" not in done.stderr, done.stderr[-2000:]


def test_a_torch_without_reset_iter_state_is_answered_by_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11 (the GPU machine's) has no ``FSDPModule.reset_iter_state``; ckptless resets FSDP2's fields
    itself there (state/fsdp.py ``_reset_iter_state``), so the touchpoint accepts the method's absence when
    the fields the fallback needs are there, and names them when they are not."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from ..harness import torch_touchpoints as tp

    monkeypatch.delattr(FSDPModule, "reset_iter_state")
    assert tp.reset_iter_state_api() == "yes: absent, ckptless's fallback"
    monkeypatch.delattr(FSDPParamGroup, "_to_sharded")
    got = tp.reset_iter_state_api()
    assert got.startswith("no: absent") and "_to_sharded" in got, got
