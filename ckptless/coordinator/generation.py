"""The job's generation counter, advanced only by fenced transactions.

Why fenced: every membership change (a recovery, an admission) starts a new
generation, and every peer message carries its generation so stale senders are
rejected. The counter must therefore never skip or repeat a value even when
several processes race, and a deposed leader must not be able to advance it:
``advance`` compares the key's mod revision it read (and optionally the
caller's leader fence) in one transaction.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from ckptless.coordinator.client import Compare, EtcdClient, Put
from ckptless.errors import CoordinatorError, FencingError


@dataclass(frozen=True)
class GenerationRecord:
    generation: int
    mod_revision: int
    reason: str


class GenerationCounter:
    def __init__(self, client: EtcdClient, key: str) -> None:
        self._client = client
        self.key = key

    def read(self) -> GenerationRecord:
        kv = self._client.get(self.key)
        if kv is None:
            return GenerationRecord(0, 0, "")
        try:
            doc = json.loads(kv.value)
            return GenerationRecord(int(doc["generation"]), kv.mod_revision, str(doc.get("reason", "")))
        except (ValueError, KeyError, TypeError) as exc:
            raise CoordinatorError(f"corrupt generation record at {self.key}: {kv.value[:100]!r}") from exc

    def advance(self, expected: GenerationRecord, reason: str, fence: Compare | None = None) -> GenerationRecord:
        """Set generation to ``expected.generation + 1`` iff nobody changed it since ``expected`` was read.

        Raises :class:`FencingError` when the key moved (or the fence failed):
        the caller must re-read the facts and decide again, never retry blindly.
        """
        new = expected.generation + 1
        token = uuid.uuid4().hex
        value = json.dumps({"generation": new, "reason": reason, "token": token})
        compare = [Compare(self.key, "mod", "==", expected.mod_revision)]
        if fence is not None:
            compare.append(fence)
        res = self._client.txn(compare, [Put(self.key, value)])
        if res.succeeded:
            return GenerationRecord(new, res.revision, reason)
        # A retried txn may have committed on its first attempt: check our token.
        kv = self._client.get(self.key)
        if kv is not None and token.encode() in kv.value:
            return GenerationRecord(new, kv.mod_revision, reason)
        current = self.read()
        raise FencingError(
            f"generation moved from {expected.generation} (rev {expected.mod_revision}) "
            f"to {current.generation} (rev {current.mod_revision}) before our bump"
        )

    def bump(self, reason: str, fence: Compare | None = None, attempts: int = 100) -> GenerationRecord:
        """Read-and-advance, retrying only on contention (not on a failed fence)."""
        last: FencingError | None = None
        for _ in range(attempts):
            current = self.read()
            try:
                return self.advance(current, reason, fence)
            except FencingError as exc:
                if fence is not None and not self._fence_holds(fence):
                    raise
                last = exc
        raise FencingError(f"generation bump lost {attempts} races in a row") from last

    def _fence_holds(self, fence: Compare) -> bool:
        return self._client.txn([fence]).succeeded
