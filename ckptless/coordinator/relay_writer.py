"""The node's workers' writes to etcd, batched by their agent (one transaction per batch).

Why: a worker writes to etcd only at the edges of a recovery (its report, its
ready mark, the "ported" mark at init), but with a client of its own each
worker holds a gRPC connection to etcd, and at an incident every survivor's
report is one etcd request: W requests, each one raft entry and one fsync.
Relayed through the node's agent (``coordinator/relay_server.py``), a node's
writes that arrive together go out as one transaction, so etcd serves
O(nodes) clients and about one request per node per phase instead of one per
rank, and a worker needs no etcd connection at all (docs/scale.md). The keys
are the same per-rank keys as before, so the leader reads what it read.

Only the keys workers write are taken (``allowed`` prefixes: reports, ready
marks, the ported mark): a worker cannot use its agent's credentials to write
anything else.

Answers: every write is answered exactly once, ``committed(revision)`` or
``failed(unavailable, why)``; ``unavailable`` means etcd did not take it (the
worker retries, as it would its own put), otherwise it was refused.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import NamedTuple

from ckptless.coordinator.client import EtcdClient, Put
from ckptless.errors import CoordinatorError, CoordinatorUnavailable

log = logging.getLogger(__name__)

MAX_BATCH = 64  # etcd's default --max-txn-ops is 128
MAX_BATCH_BYTES = 512 * 1024  # etcd's default --max-request-bytes is 1.5 MiB


class Answer(NamedTuple):
    revision: int  # etcd's revision of the commit; 0 when not committed
    unavailable: bool  # not committed because etcd could not be reached (retry)
    why: str  # empty when committed


Reply = Callable[[Answer], None]


class RelayWriter:
    def __init__(self, client: Callable[[], EtcdClient | None], allowed: tuple[str, ...],
                 timeout_s: float | None = None) -> None:
        """``client``: the agent's current etcd client (None while it has none); ``allowed``: the key
        prefixes workers may write; ``timeout_s``: each transaction's deadline (the client's default)."""
        self._client, self._allowed, self._timeout_s = client, allowed, timeout_s
        self._queue: queue.SimpleQueue[tuple[str, bytes, Reply] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="ckptless-relay-writer", daemon=True)
        self._thread.start()

    def submit(self, key: str, value: bytes, reply: Reply) -> None:
        """Queue one put; ``reply`` is called once with its answer (on the writer's thread, or here
        when the key is refused)."""
        if not key.startswith(self._allowed):
            reply(Answer(0, False, f"the control relay does not write {key!r}: a worker writes only "
                                   f"under {', '.join(self._allowed)}"))
            return
        self._queue.put((key, value, reply))

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch, size = [first], len(first[0]) + len(first[1])
            while len(batch) < MAX_BATCH and size < MAX_BATCH_BYTES:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)  # close after this batch
                    break
                batch.append(nxt)
                size += len(nxt[0]) + len(nxt[1])
            self._commit(batch)

    def _commit(self, batch: list[tuple[str, bytes, Reply]]) -> None:
        """One transaction for the batch; if etcd refuses the transaction as such (not unreachable),
        each write is put on its own, so no write fails for another's sake."""
        client = self._client()
        if client is None:
            _answer(batch, Answer(0, True, "the agent has no etcd connection"))
            return
        # One put per key, the newest value: etcd refuses a transaction naming a key twice (every
        # worker writes the ported mark at init), and in order the later put would win anyway.
        last: dict[str, bytes] = {}
        for k, v, _ in batch:
            last.pop(k, None)
            last[k] = v
        try:
            result = client.txn([], [Put(k, v) for k, v in last.items()], timeout_s=self._timeout_s)
        except CoordinatorUnavailable as exc:
            _answer(batch, Answer(0, True, str(exc)))
            return
        except CoordinatorError as exc:
            if len(batch) == 1:
                _answer(batch, Answer(0, False, str(exc)))
                return
            log.warning("control relay: etcd refused a batch of %d writes (%s); putting each alone", len(batch), exc)
            for item in batch:
                self._commit([item])
            return
        _answer(batch, Answer(result.revision, False, ""))

    def close(self) -> None:
        """Stop after what is queued; later writes are never answered (their relay is closed too)."""
        self._queue.put(None)


def _answer(batch: list[tuple[str, bytes, Reply]], answer: Answer) -> None:
    for _, _, reply in batch:
        try:
            reply(answer)
        except Exception:  # noqa: BLE001 - one subscriber's socket must not cost the others their answer
            log.debug("control relay: an answer could not be sent", exc_info=True)
