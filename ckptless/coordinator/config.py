"""Validated configuration of the etcd connection (one dataclass per component)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ckptless import environment
from ckptless.errors import ConfigError

DEFAULT_ETCD_PORT = 2379


def parse_endpoint(text: str, field_name: str = "endpoints") -> tuple[str, int]:
    """``host[:port]`` (optionally ``http://``/``https://``) into (host, port)."""
    raw = text.strip()
    for scheme in ("http://", "https://"):
        if raw.startswith(scheme):
            raw = raw[len(scheme):]
    raw = raw.rstrip("/")
    if not raw:
        raise ConfigError(field_name, text, "empty endpoint; expected host:port")
    if raw.startswith("["):  # [ipv6]:port
        host, _, rest = raw[1:].partition("]")
        port_text = rest.removeprefix(":")
    else:
        host, sep, port_text = raw.rpartition(":")
        if not sep:
            host, port_text = raw, ""
    if not host:
        raise ConfigError(field_name, text, "missing host; expected host:port")
    if not port_text:
        return host, DEFAULT_ETCD_PORT
    try:
        port = int(port_text)
    except ValueError as exc:
        raise ConfigError(field_name, text, f"port {port_text!r} is not a number") from exc
    if not 0 < port < 65536:
        raise ConfigError(field_name, text, f"port {port} out of range 1-65535")
    return host, port


@dataclass(frozen=True)
class EtcdConfig:
    """How to reach etcd. Validated on construction; errors name field and value.

    ``request_timeout_s`` bounds one gRPC call; ``call_deadline_s`` bounds a
    call including its retries (long enough to ride out an etcd restart);
    ``retry_interval_s`` is how long a failed endpoint is skipped (pyetcd's
    default of 300 s would make a restart look permanent).
    """

    endpoints: tuple[str, ...]
    request_timeout_s: float = 2.0
    call_deadline_s: float = 10.0
    connect_timeout_s: float = 5.0
    retry_interval_s: float = 0.2
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    ca_cert: str | None = None
    cert_key: str | None = None
    cert_cert: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.endpoints, str):
            object.__setattr__(self, "endpoints", tuple(e for e in self.endpoints.split(",") if e.strip()))
        if not self.endpoints:
            raise ConfigError("endpoints", self.endpoints, "at least one etcd endpoint is required")
        for ep in self.endpoints:
            parse_endpoint(ep)
        for name in ("request_timeout_s", "call_deadline_s", "connect_timeout_s", "retry_interval_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(name, value, "must be a positive number of seconds")
        if (self.user is None) != (self.password is None):
            raise ConfigError("user" if self.user is None else "password", None, "user and password must be given together")
        if (self.cert_key is None) != (self.cert_cert is None):
            raise ConfigError("cert_key", self.cert_key, "client TLS needs both cert_key and cert_cert")
        if self.cert_key is not None and self.ca_cert is None:
            raise ConfigError("ca_cert", None, "client TLS certificates need a CA certificate")

    @property
    def secure(self) -> bool:
        return self.ca_cert is not None or any(e.strip().startswith("https://") for e in self.endpoints)

    def host_ports(self) -> list[tuple[str, int]]:
        return [parse_endpoint(e) for e in self.endpoints]

    @classmethod
    def from_env(cls, endpoints: str | tuple[str, ...], env: Mapping[str, str] | None = None) -> EtcdConfig:
        """Endpoints plus TLS/auth from ``CKPTLESS_ETCD_*`` (one rule for agents, workers and ``ckptless
        status`` alike; workers inherit the variables from their agent).

        ``env`` None: this process's settings (:func:`ckptless.environment.current`); else the
        variables are parsed from ``env`` by the same table (:data:`ckptless.environment.VARIABLES`).
        """
        settings = environment.current() if env is None else environment.ProcessEnv.from_mapping(env)
        creds = settings.etcd_credentials()
        eps = tuple(x for x in endpoints.split(",") if x.strip()) if isinstance(endpoints, str) else endpoints
        return cls(eps, **creds)  # type: ignore[arg-type]
