"""A lease-backed session, like etcd's ``clientv3/concurrency.Session``.

Why: every liveness fact in ckptless (an agent's node key, a worker's
heartbeat, the leader key) is attached to a lease, so that when its owner
dies etcd deletes the facts by itself within the TTL. The session keeps the
lease alive from its own thread at TTL/3 and sets ``done`` the moment the
lease is known lost, so owners can stop acting on stale authority.
"""

from __future__ import annotations

import logging
import threading
import time

from ckptless.coordinator.client import EtcdClient
from ckptless.errors import ConfigError, CoordinatorError, SessionExpired

log = logging.getLogger(__name__)


class Session:
    """Grant a lease and keep it alive until :meth:`close` or :meth:`orphan`.

    * ``close()`` revokes the lease: its keys vanish at once (clean exit).
    * ``orphan()`` stops the keepalive without revoking: the keys vanish when
      the TTL runs out (what a crash looks like; used by tests and hand-over).
    * ``done`` is set when the lease is gone for any reason.
    """

    def __init__(self, client: EtcdClient, ttl_s: float = 2.0, name: str = "session",
                 grant_timeout_s: float | None = None) -> None:
        if ttl_s < 1:
            raise ConfigError("lease_ttl", ttl_s, "etcd leases need a TTL of at least 1 second")
        self._client = client
        self.ttl_s = int(round(ttl_s))
        self.name = name
        self.lease_id = client.grant_lease(self.ttl_s, timeout_s=grant_timeout_s)
        self.done = threading.Event()
        self._stop = threading.Event()
        self._last_ok = time.monotonic()
        self._thread = threading.Thread(target=self._keepalive, name=f"ckptless-keepalive:{name}", daemon=True)
        self._thread.start()

    def _keepalive(self) -> None:
        interval = self.ttl_s / 3.0
        while not self._stop.wait(interval):
            try:
                remaining = self._client.refresh_lease(self.lease_id, timeout_s=max(interval, 0.3))
            except CoordinatorError as exc:
                # etcd cannot expire a lease while it is down, and a restarted etcd
                # renews every lease to its full TTL: an outage alone does not lose
                # the lease. Give up only after the TTL plus the client's own
                # deadline; a reachable server answering TTL <= 0 is the real proof.
                if time.monotonic() - self._last_ok > self.ttl_s + self._client.config.call_deadline_s:
                    log.warning("session %s: lease %x presumed lost (%s)", self.name, self.lease_id, exc)
                    self.done.set()
                    return
                continue
            if remaining <= 0:
                log.warning("session %s: lease %x expired", self.name, self.lease_id)
                self.done.set()
                return
            self._last_ok = time.monotonic()

    def check(self) -> None:
        """Raise :class:`SessionExpired` if the lease is gone."""
        if self.done.is_set():
            raise SessionExpired(f"session {self.name}: lease {self.lease_id:x} is gone")

    def orphan(self) -> None:
        """Stop keeping the lease alive, leaving it to expire on its own."""
        self._stop.set()
        self._thread.join(timeout=self.ttl_s + 1)

    def close(self) -> None:
        """Revoke the lease (deleting its keys now) and stop the keepalive."""
        self.orphan()
        if not self.done.is_set():
            try:
                self._client.revoke_lease(self.lease_id, timeout_s=2.0)
            except CoordinatorError:
                log.info("session %s: revoke failed; lease will expire in %ss", self.name, self.ttl_s)
        self.done.set()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
