"""CI's time budget (20 minutes for `make test` and `make test-loaded` together): some long e2e
tests take turns.

Why: each multi-process e2e test costs 15-35 s here, and CI holds about 55 of them. A test marked
``@pytest.mark.rotating(turn)`` covers a fault that another CI test also drives through the same
code (a second spare path, a second restart path, a longer variant of a detection). There are
``TURNS`` turns; a run holds the tests of one turn and marks the others ``slow``, like the flag x
fault matrix's jobs (tests/e2e/test_flag_fault_matrix.py). The turn is the UTC day's ordinal modulo
``TURNS``, so consecutive CI days cover the other turns and every rotating test runs at least every
fourth day on main. The turns are assigned by hand, so they weigh about the same (seconds, not
counts) and a run's choice does not depend on which files it collected. ``CKPTLESS_MATRIX_SEED=N``
reproduces day N's choice; ``make test-all`` runs every test.
"""

from __future__ import annotations

import datetime
import os

import pytest

TURNS = 4  # four since 2026-11-29 (torchtitan's install and tests): two clean-clone runs of turn 2 of three
# took 22.0 and 24.4 min of CI's 25; three since issue 22's tests (2026-11-27)


def ci_seed() -> int:
    """The day's seed (the UTC date's ordinal), or ``CKPTLESS_MATRIX_SEED``."""
    given = os.environ.get("CKPTLESS_MATRIX_SEED", "")
    return int(given) if given else datetime.datetime.now(datetime.timezone.utc).date().toordinal()


def rotate_items(items: list[pytest.Item]) -> None:
    """Marks ``slow`` each rotating test whose turn is not today's."""
    today = ci_seed() % TURNS
    for it in items:
        mark = it.get_closest_marker("rotating")
        if mark is None:
            continue
        turn = mark.args[0] if mark.args else None
        if not isinstance(turn, int) or not 0 <= turn < TURNS:
            raise pytest.UsageError(f"{it.nodeid}: rotating(turn) needs a turn in 0..{TURNS - 1}, got {turn!r}")
        if turn != today:
            it.add_marker(pytest.mark.slow)
