"""The only boundary between ckptless and etcd.

Why a wrapper around ``pyetcd``:

* every client error is translated into :mod:`ckptless.errors` with
  ``raise ... from exc`` so nothing above this module sees grpc or pyetcd types;
* pyetcd marks an endpoint "failed" for ``time_retry`` seconds (300 by default)
  after one UNAVAILABLE error, which makes an etcd restart look permanent. We
  use a short ``time_retry`` and retry each call until its deadline;
* pyetcd does not re-create watches after the stream breaks; :class:`Watch`
  re-creates them from the last revision it delivered, so no event is lost or
  repeated across an etcd restart.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import grpc
import pyetcd
from pyetcd import exceptions as etcd_exc

from ckptless.coordinator.config import EtcdConfig
from ckptless.errors import (
    CoordinatorAuthError,
    CoordinatorError,
    CoordinatorTimeout,
    CoordinatorUnavailable,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

_RETRYABLE: tuple[type[BaseException], ...] = (
    etcd_exc.ConnectionFailedError,
    etcd_exc.ConnectionTimeoutError,
    etcd_exc.NoServerAvailableError,
    etcd_exc.InternalServerError,
    ValueError,  # pyetcd: "Trying to use a failed node" while inside time_retry
)


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    def as_put(self) -> "WatchEvent":
        """This key as the put event a watch would have delivered (to feed a read through a watch callback)."""
        return WatchEvent("put", self.key, self.value, self.mod_revision, self.create_revision)


@dataclass(frozen=True)
class WatchEvent:
    kind: Literal["put", "delete"]
    key: str
    value: bytes
    mod_revision: int
    create_revision: int


# --- transaction vocabulary (kept independent of pyetcd's classes) -----------
@dataclass(frozen=True)
class Compare:
    """``target(key) op value``; target is create/mod/version (ints) or value (bytes)."""

    key: str
    target: Literal["create", "mod", "version", "value"]
    op: Literal["==", "!=", "<", ">"]
    value: int | bytes | str


@dataclass(frozen=True)
class Put:
    key: str
    value: bytes | str
    lease: int | None = None


@dataclass(frozen=True)
class Delete:
    key: str
    prefix: bool = False


@dataclass(frozen=True)
class Get:
    key: str
    prefix: bool = False


TxnOp = Put | Delete | Get


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int
    # For each Get op, in order: the key-values it read.
    reads: tuple[tuple[KeyValue, ...], ...]


def _prefix_end(prefix: str) -> bytes:
    raw = bytearray(prefix.encode())
    for i in range(len(raw) - 1, -1, -1):
        if raw[i] < 0xFF:
            raw[i] += 1
            return bytes(raw[: i + 1])
    return b"\0"


def _to_bytes(v: bytes | str) -> bytes:
    return v.encode() if isinstance(v, str) else v


class EtcdClient:
    """A thread-safe etcd v3 client with deadlines, retries and typed errors."""

    def __init__(self, config: EtcdConfig, connect_deadline_s: float | None = None) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._closed = False
        deadline = time.monotonic() + (connect_deadline_s if connect_deadline_s is not None else config.connect_timeout_s)
        self._raw = self._retry(self._connect, deadline, "connect")
        # Fail fast with a clear message when nothing answers.
        self._retry(lambda: self._raw.status(), deadline, "status")

    # --- construction ------------------------------------------------------
    def _connect(self) -> pyetcd.MultiEndpointEtcd3Client:
        creds = None
        if self.config.secure:
            try:
                if self.config.ca_cert is None:
                    creds = grpc.ssl_channel_credentials()  # system roots
                else:
                    creds = pyetcd.MultiEndpointEtcd3Client.get_secure_creds(
                        self.config.ca_cert, self.config.cert_key, self.config.cert_cert
                    )
            except OSError as exc:
                raise CoordinatorAuthError(f"cannot read etcd TLS files: {exc}") from exc
        endpoints = [
            pyetcd.Endpoint(host, port, secure=self.config.secure, creds=creds, time_retry=self.config.retry_interval_s)
            for host, port in self.config.host_ports()
        ]
        try:
            raw = pyetcd.MultiEndpointEtcd3Client(
                endpoints=endpoints,
                timeout=self.config.request_timeout_s,
                user=self.config.user,
                password=self.config.password,
                failover=True,
            )
            if not self.config.secure:
                # gRPC refuses call credentials on a plaintext channel; the auth
                # token still travels as request metadata, which etcd accepts.
                raw.call_credentials = None
            return raw
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED):
                raise CoordinatorAuthError(f"etcd authentication failed for user {self.config.user!r}: {exc.details()}") from exc
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise CoordinatorAuthError(f"etcd rejected credentials (auth not enabled?): {exc.details()}") from exc
            raise etcd_exc.ConnectionFailedError() from exc

    @property
    def raw(self) -> pyetcd.MultiEndpointEtcd3Client:
        return self._raw

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._raw.close()
        except Exception:  # noqa: BLE001 - closing is best effort
            log.debug("etcd client close failed", exc_info=True)

    def __enter__(self) -> EtcdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- retry / translation -----------------------------------------------
    def _retry(self, fn: Callable[[], T], deadline: float, what: str) -> T:
        delay = 0.02
        last: BaseException | None = None
        reauthed = False
        while True:
            try:
                return fn()
            except CoordinatorError:
                raise
            except _RETRYABLE as exc:
                last = exc
            except grpc.RpcError as exc:
                code = exc.code()
                if code == grpc.StatusCode.UNAUTHENTICATED and self.config.user and not reauthed and what != "connect":
                    # etcd's simple tokens expire (5 min by default): log in again once.
                    reauthed = True
                    self._raw = self._connect()
                    continue
                if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    raise CoordinatorAuthError(f"etcd {what}: {exc.details()}") from exc
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL):
                    raise CoordinatorError(f"etcd {what} failed: {code.name}: {exc.details()}") from exc
                last = exc
            except etcd_exc.Etcd3Exception as exc:
                raise CoordinatorError(f"etcd {what} failed: {exc!r}") from exc
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                endpoints = ",".join(self.config.endpoints)
                if isinstance(last, etcd_exc.ConnectionTimeoutError):
                    raise CoordinatorTimeout(f"etcd {what} at {endpoints}: timed out") from last
                raise CoordinatorUnavailable(f"etcd unreachable at {endpoints} ({what}): {last!r}") from last
            time.sleep(min(delay, remaining))  # back-off between retries, bounded by the deadline
            delay = min(delay * 2, 0.25)

    def _call(self, fn: Callable[[], T], what: str, timeout_s: float | None = None) -> T:
        budget = self.config.call_deadline_s if timeout_s is None else timeout_s
        return self._retry(fn, time.monotonic() + budget, what)

    # --- KV ----------------------------------------------------------------
    @staticmethod
    def _kv(value: bytes, meta: Any) -> KeyValue:
        return KeyValue(
            key=meta.key.decode(),
            value=bytes(value),
            create_revision=int(meta.create_revision),
            mod_revision=int(meta.mod_revision),
            version=int(meta.version),
            lease=int(meta.lease_id),
        )

    def get(self, key: str, timeout_s: float | None = None) -> KeyValue | None:
        value, meta = self._call(lambda: self._raw.get(key), f"get {key}", timeout_s)
        return None if meta is None else self._kv(value, meta)

    def get_prefix(self, prefix: str, timeout_s: float | None = None) -> tuple[list[KeyValue], int]:
        """All keys under ``prefix`` sorted by key, and the store revision they were read at."""

        def op() -> tuple[list[KeyValue], int]:
            resp = self._raw.get_prefix_response(prefix, sort_order="ascend", sort_target="key")
            kvs = [
                KeyValue(kv.key.decode(), bytes(kv.value), kv.create_revision, kv.mod_revision, kv.version, kv.lease)
                for kv in resp.kvs
            ]
            return kvs, int(resp.header.revision)

        return self._call(op, f"get_prefix {prefix}", timeout_s)

    def put(self, key: str, value: bytes | str, lease: int | None = None, timeout_s: float | None = None) -> int:
        resp = self._call(lambda: self._raw.put(key, _to_bytes(value), lease=lease), f"put {key}", timeout_s)
        return int(resp.header.revision)

    def delete(self, key: str, timeout_s: float | None = None) -> bool:
        return bool(self._call(lambda: self._raw.delete(key), f"delete {key}", timeout_s))

    def delete_prefix(self, prefix: str, timeout_s: float | None = None) -> int:
        resp = self._call(lambda: self._raw.delete_prefix(prefix), f"delete_prefix {prefix}", timeout_s)
        return int(resp.deleted)

    def revision(self, timeout_s: float | None = None) -> int:
        """The store's current revision (cheap: a limit-1 range on a key that never exists)."""
        resp = self._call(lambda: self._raw.get_response("\0ckptless-revision-probe"), "revision", timeout_s)
        return int(resp.header.revision)

    # --- transactions ------------------------------------------------------
    def _build_compare(self, c: Compare) -> Any:
        t = self._raw.transactions
        target = {"create": t.create, "mod": t.mod, "version": t.version, "value": t.value}[c.target](c.key)
        value: Any = _to_bytes(c.value) if c.target == "value" and not isinstance(c.value, int) else c.value
        if c.op == "==":
            return target == value
        if c.op == "!=":
            return target != value
        if c.op == "<":
            return target < value
        return target > value

    def _build_op(self, op: TxnOp) -> Any:
        t = self._raw.transactions
        if isinstance(op, Put):
            return t.put(op.key, _to_bytes(op.value), lease=op.lease)
        if isinstance(op, Delete):
            return t.delete(op.key, range_end=_prefix_end(op.key) if op.prefix else None)
        return t.get(op.key, range_end=_prefix_end(op.key) if op.prefix else None)

    def txn(
        self,
        compare: Sequence[Compare],
        success: Sequence[TxnOp] = (),
        failure: Sequence[TxnOp] = (),
        timeout_s: float | None = None,
    ) -> TxnResult:
        """One atomic etcd transaction.

        A transaction retried after a lost reply may report ``succeeded=False``
        although its first attempt committed; every fenced caller therefore
        re-reads what it wrote (values carry a unique token) instead of
        trusting the flag alone.
        """
        cmp = [self._build_compare(c) for c in compare]
        ok_ops = [self._build_op(o) for o in success]
        fail_ops = [self._build_op(o) for o in failure]
        def run() -> TxnResult:
            succeeded, responses = self._raw.transaction(compare=cmp, success=ok_ops, failure=fail_ops)
            branch = success if succeeded else failure
            reads: list[tuple[KeyValue, ...]] = []
            revision = 0
            for op, resp in zip(branch, responses):
                if isinstance(op, Get):
                    reads.append(tuple(self._kv(v, m) for v, m in resp))
                    if resp:
                        revision = max(revision, int(resp[0][1].response_header.revision))
                else:
                    hdr = getattr(getattr(resp, resp.WhichOneof("response")), "header", None)
                    if hdr is not None:
                        revision = max(revision, int(hdr.revision))
            return TxnResult(bool(succeeded), revision, tuple(reads))

        return self._call(run, "txn", timeout_s)

    # --- leases ------------------------------------------------------------
    def grant_lease(self, ttl_s: int, timeout_s: float | None = None) -> int:
        lease = self._call(lambda: self._raw.lease(int(ttl_s)), "lease grant", timeout_s)
        return int(lease.id)

    def refresh_lease(self, lease_id: int, timeout_s: float | None = None) -> int:
        """Send one keepalive; returns the remaining TTL (0 or less: the lease is gone)."""

        def op() -> int:
            responses = list(self._raw.refresh_lease(lease_id))
            return int(responses[0].TTL) if responses else 0

        return self._call(op, "lease keepalive", timeout_s)

    def revoke_lease(self, lease_id: int, timeout_s: float | None = None) -> None:
        try:
            self._call(lambda: self._raw.revoke_lease(lease_id), "lease revoke", timeout_s)
        except CoordinatorError as exc:
            if "requested lease not found" in str(exc.__cause__ or exc):
                return
            raise

    def lease_ttl(self, lease_id: int, timeout_s: float | None = None) -> int:
        """Remaining TTL of a lease in seconds; -1 when it does not exist."""
        info = self._call(lambda: self._raw.get_lease_info(lease_id), "lease ttl", timeout_s)
        return int(info.TTL)

    # --- watches -----------------------------------------------------------
    def watch_prefix(
        self,
        prefix: str,
        on_events: Callable[[list[WatchEvent]], None],
        start_revision: int | None = None,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> Watch:
        """Watch every key under ``prefix`` from ``start_revision`` (default: now + 1).

        The returned :class:`Watch` survives etcd restarts and client
        reconnects: it re-creates itself from the last delivered revision + 1.
        """
        w = Watch(self, prefix, on_events, start_revision, on_error)
        w.start()
        return w


class Watch:
    """A self-healing prefix watch; see :meth:`EtcdClient.watch_prefix`."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        on_events: Callable[[list[WatchEvent]], None],
        start_revision: int | None,
        on_error: Callable[[BaseException], None] | None,
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._on_events = on_events
        self._on_error = on_error
        self._next_revision = start_revision
        self._lock = threading.Lock()
        self._cancelled = threading.Event()
        self._broken = threading.Event()
        self._watch_id: int | None = None
        self._thread = threading.Thread(target=self._supervise, name=f"ckptless-watch:{prefix}", daemon=True)
        self.reconnects = 0

    @property
    def next_revision(self) -> int | None:
        return self._next_revision

    def start(self) -> None:
        if self._next_revision is None:
            self._next_revision = self._client.revision() + 1
        self._create()
        self._thread.start()

    def _create(self) -> None:
        raw = self._client.raw
        watch_id = raw.add_watch_prefix_callback(self._prefix, self._callback, start_revision=self._next_revision)
        with self._lock:
            self._watch_id = watch_id
            self._broken.clear()

    def _callback(self, resp: Any) -> None:
        if isinstance(resp, BaseException):
            if not self._cancelled.is_set():
                log.info("watch on %s broke (%r); will re-create from revision %s", self._prefix, resp, self._next_revision)
                self._broken.set()
            return
        out: list[WatchEvent] = []
        for ev in resp.events:
            kind: Literal["put", "delete"] = "delete" if isinstance(ev, pyetcd.events.DeleteEvent) else "put"
            out.append(WatchEvent(kind, ev.key.decode(), bytes(ev.value), int(ev.mod_revision), int(ev.create_revision)))
        if out:
            self._next_revision = out[-1].mod_revision + 1
            try:
                self._on_events(out)
            except Exception:  # noqa: BLE001 - a faulty subscriber must not kill the watch
                log.exception("watch subscriber for %s failed", self._prefix)

    def _supervise(self) -> None:
        """Re-create the watch whenever its stream breaks, until cancelled."""
        while not self._cancelled.is_set():
            if not self._broken.wait(timeout=0.5):
                continue
            if self._cancelled.is_set():
                return
            try:
                self._create()
                self.reconnects += 1
            except Exception as exc:  # noqa: BLE001 - keep trying until cancelled
                if self._on_error is not None:
                    self._on_error(exc)
                self._cancelled.wait(0.1)

    def cancel(self) -> None:
        self._cancelled.set()
        self._broken.set()
        with self._lock:
            watch_id = self._watch_id
        if watch_id is not None:
            try:
                self._client.raw.cancel_watch(watch_id)
            except Exception:  # noqa: BLE001 - cancel is best effort on a closing client
                log.debug("cancel_watch failed", exc_info=True)
        self._thread.join(timeout=2.0)
