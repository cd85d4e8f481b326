"""Prometheus metrics of a node agent: generation, incidents, last recovery by phase, mirror health, spares.

Why a small wrapper instead of module-level metrics: an agent (and a test)
may create several exporters in one process; each gets its own registry, so
metric names never collide, and the HTTP server it starts is its own and can
be stopped. Values are pushed by whoever knows them (the agent); nothing here
samples or polls, so a scrape never blocks the agent. Every metric carries
``job`` and ``node`` labels so one Prometheus can scrape every agent of
every job.

Usage (agent)::

    metrics = MetricsExporter(job_id=cfg.run_id, node_id=node_id)
    port = metrics.start(port=cfg.metrics_port or 0, host="0.0.0.0")   # 0: any free port
    log.info("metrics on http://%s:%d/metrics", host, port)
    metrics.set_generation(m.generation)                 # on every new membership
    metrics.record_incident()                            # when a generation fails
    metrics.set_last_recovery({"detection": 0.07, "reformation": 0.86, "total": 1.82})
    metrics.set_committed_version(v); metrics.set_mirror_lag(newest - v)
    metrics.set_replica_bytes(store.bytes_held()); metrics.set_own_image_bytes(pool); metrics.set_spares_free(n)
    metrics.stop()                                       # at exit
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest, start_http_server

from ckptless.errors import ConfigError
from ckptless.goodput import PHASES, IncidentView

# Phases reported by ``last_recovery_seconds``: the merged incident phases, the
# leader's decision (incident opened -> plan published, set by the agent), the
# background re-protection, and two totals.
RECOVERY_PHASES = (*PHASES, "decision", "reprotection", "total", "kill_to_first_step")
_LABELS = ("job", "node")
log = logging.getLogger(__name__)
_F = TypeVar("_F", bound=Callable[..., None])


def _never_raises(update: _F) -> _F:
    """Telemetry never ends a job: an update that fails (a bad value, a bug here, a
    prometheus_client error) is logged once per method and dropped, never raised into the
    agent loop that called it (an unknown phase name once killed both agents of a job on
    its first recovery)."""
    warned: list[bool] = []

    @functools.wraps(update)
    def guarded(*args: Any, **kwargs: Any) -> None:
        try:
            update(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - telemetry must not fail the caller
            if not warned:
                warned.append(True)
                log.warning("metrics: %s dropped (%s); the job goes on", update.__name__, exc)
    return guarded  # type: ignore[return-value]


class MetricsExporter:
    """Gauges and a counter for one agent, served over HTTP by :meth:`start`."""

    def __init__(self, job_id: str = "", node_id: str = "", registry: CollectorRegistry | None = None,
                 namespace: str = "ckptless") -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self._lv = (job_id, node_id)
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self.host: str | None = None
        self.port: int | None = None
        ns, reg = namespace, self.registry
        self._generation = Gauge("generation", "Current generation of the job (bumped by every recovery).",
                                 _LABELS, namespace=ns, registry=reg).labels(*self._lv)
        self._incidents = Counter("incidents", "Incidents (generation failures) seen by this agent.",
                                  _LABELS, namespace=ns, registry=reg).labels(*self._lv)
        self._recovery = Gauge("last_recovery_seconds", "Duration of each phase of the most recent recovery.",
                               (*_LABELS, "phase"), namespace=ns, registry=reg)
        self._lag = Gauge("mirror_lag_versions", "Newest captured version minus the committed version.",
                          _LABELS, namespace=ns, registry=reg).labels(*self._lv)
        self._committed = Gauge("committed_version", "Newest version held by every rank and its K mirrors.",
                                _LABELS, namespace=ns, registry=reg).labels(*self._lv)
        self._bytes = Gauge("replica_bytes_held", "Bytes of peers' images held in this node's peer stores.",
                            _LABELS, namespace=ns, registry=reg).labels(*self._lv)
        self._waiting = Gauge("replacement_waiting_since", "Unix time since which the job waits for a replacement "
                              "node for lost ranks (0: not waiting; --replacement-timeout).", _LABELS, namespace=ns,
                              registry=reg).labels(*self._lv)
        self._own = Gauge("own_image_bytes", "Bytes of this node's ranks' own capture buffers (committed image, "
                          "the one in flight).", _LABELS, namespace=ns, registry=reg).labels(*self._lv)
        self._spares = Gauge("spares_free", "Warm spares waiting for a rank (job-wide, as seen in etcd).",
                             _LABELS, namespace=ns, registry=reg).labels(*self._lv)
        self._link = Gauge("mirror_link_bits_per_second", "The rate this node measured, once at start, on the "
                           "link its mirrors use to one peer node (ckptless.mirror.link).",
                           (*_LABELS, "interface", "peer"), namespace=ns, registry=reg)
        for phase in RECOVERY_PHASES:  # present from the first scrape, 0 until a recovery happened
            self._recovery.labels(*self._lv, phase).set(0.0)

    # --- serving -----------------------------------------------------------------
    def start(self, port: int = 0, host: str = "127.0.0.1") -> int:
        """Serve ``/metrics`` on ``host:port`` (port 0: a free one) in a daemon thread; returns the port."""
        if self._server is not None:
            raise ConfigError("metrics", f"{self.host}:{self.port}", "exporter already started")
        if not 0 <= port < 65536:
            raise ConfigError("metrics_port", port, "must be 0 (any free port) or 1-65535")
        try:
            server, thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise ConfigError("metrics_port", f"{host}:{port}", f"cannot listen ({exc.strerror or exc})") from exc
        self._server, self._thread = server, thread
        self.host, self.port = host, int(server.server_port)
        return self.port

    @property
    def url(self) -> str | None:
        return None if self.port is None else f"http://{self.host}:{self.port}/metrics"

    def stop(self) -> None:
        """Stop serving (idempotent); the values stay readable through :meth:`render`."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def render(self) -> bytes:
        """The exposition text a scrape would return (for tests and ``ckptless status``)."""
        return bytes(generate_latest(self.registry))

    # --- updates (each guarded by _never_raises) --------------------------------------
    @_never_raises
    def set_generation(self, generation: int) -> None:
        self._generation.set(generation)

    @_never_raises
    def record_incident(self, count: int = 1) -> None:
        self._incidents.inc(count)

    @_never_raises
    def set_last_recovery(self, phases: Mapping[str, float]) -> None:
        """Replace the last recovery's figures; phases not given are reset to 0 (no stale labels).
        An unknown phase is a caller's bug: it is logged (by the guard) and nothing is changed."""
        unknown = set(phases) - set(RECOVERY_PHASES)
        if unknown:
            raise ConfigError("phase", sorted(unknown)[0], f"unknown recovery phase; one of {RECOVERY_PHASES}")
        for phase in RECOVERY_PHASES:
            self._recovery.labels(*self._lv, phase).set(float(phases.get(phase, 0.0)))

    @_never_raises
    def record_recovery(self, incident: IncidentView) -> None:
        """:meth:`set_last_recovery` from a merged incident of :func:`ckptless.goodput.analyze`."""
        phases = dict(incident.phases)
        if incident.reprotect_s is not None:
            phases["reprotection"] = incident.reprotect_s
        if incident.downtime_s is not None:
            phases["total"] = incident.downtime_s
        if incident.kill_to_first_step_s is not None:
            phases["kill_to_first_step"] = incident.kill_to_first_step_s
        self.set_last_recovery(phases)

    @_never_raises
    def set_mirror_lag(self, versions: int) -> None:
        self._lag.set(versions)

    @_never_raises
    def set_committed_version(self, version: int) -> None:
        self._committed.set(version)

    @_never_raises
    def set_replica_bytes(self, nbytes: int) -> None:
        self._bytes.set(nbytes)

    @_never_raises
    def set_replacement_waiting(self, since_unix: float) -> None:
        self._waiting.set(since_unix)

    @_never_raises
    def set_own_image_bytes(self, nbytes: int) -> None:
        self._own.set(nbytes)

    @_never_raises
    def set_spares_free(self, n: int) -> None:
        self._spares.set(n)

    @_never_raises
    def set_mirror_link(self, interface: str, peer: str, bits_per_s: float) -> None:
        self._link.labels(*self._lv, interface, peer).set(bits_per_s)

    def __enter__(self) -> MetricsExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
