"""Every private or version-dependent torch attribute ckptless touches exists on the torch under test
(tests/harness/torch_touchpoints.py; docs/compatibility.md's inventory).

Why: these are the places a torch release breaks ckptless without a deprecation cycle, and most of them
act only in a recovery (a restore, a re-formation), where a missing attribute is an AttributeError in the
middle of an incident. CI runs this on torch 2.13.0 and ``make test-compat`` on 2.14.1, so a rename
fails here, named, before any job meets it. A CPU build cannot show ProcessGroupNCCL's (``n/a``).
"""

from __future__ import annotations

import pytest

from ..harness.torch_touchpoints import TOUCHPOINTS, Touchpoint


@pytest.mark.parametrize("touchpoint", TOUCHPOINTS, ids=lambda t: t.where())
def test_touchpoint_exists_on_this_torch(touchpoint: Touchpoint) -> None:
    got = touchpoint.probe()
    assert not got.startswith("no"), f"{touchpoint.where()}: {touchpoint.what}: {got}"


def test_every_touchpoint_names_a_line_of_the_product() -> None:
    """The inventory follows the code: a touchpoint whose line is gone is a stale row."""
    stale = [t.where() for t in TOUCHPOINTS if t.where().endswith("not found)")]
    assert not stale, stale
