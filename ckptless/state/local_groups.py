"""What state that replays collectives on restore asks of a process group: does it answer locally?

Why a protocol of its own, here: restoring a DDP reducer (``state/ddp.py``) replays its bucket all-reduce
and broadcast, which must stay in this process; only the worker's rebindable group
(``worker/rebindable.py``) can say so. The state package sits below the worker's and must not import it,
so the question is declared here, where both can import it, and the group says it answers it (checked by
mypy there, and at run time here) instead of being found by name.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class AnswersLocally(Protocol):
    def answers_locally(self) -> bool:
        """True while every collective on this group stays in this process (unbound, or local-only)."""
        ...
