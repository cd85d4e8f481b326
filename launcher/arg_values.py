"""Values of ``ckptless-run``'s flags, parsed and checked one at a time (``launcher/args.py`` builds the
parser and the whole configuration from them).

Why apart: each parser here is pure (a string in, a typed value or one ``ConfigError`` naming the
field out) and is tested on its own; the parser module keeps the flags and their cross-checks.
"""

from __future__ import annotations

import os
import re
import signal
from dataclasses import dataclass
from enum import IntFlag

from ckptless.errors import ConfigError

DEFAULT_ETCD_PORT = 2379
_VALUE_RE = re.compile(r"^[0123]$")
_MAPPING_RE = re.compile(r"^(\d:[0123],)*(\d:[0123])$")


class Std(IntFlag):
    """Which standard streams of a worker go to a file (same bits as torchrun's Std)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


@dataclass(frozen=True)
class Endpoint:
    """A host and port; ``str()`` gives ``host:port`` with IPv6 bracketed."""

    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


# --- resolution -------------------------------------------------------------
def parse_nnodes(value: str) -> tuple[int, int]:
    """``"N"`` or ``"MIN:MAX"`` -> (min, max) with 0 < min <= max."""
    parts = value.split(":")
    _check(len(parts) <= 2, "nnodes", value, 'expected "N" or "MIN:MAX"')
    try:
        lo, hi = int(parts[0]), int(parts[-1])
    except ValueError as exc:
        raise ConfigError("nnodes", value, 'expected "N" or "MIN:MAX" with integers') from exc
    _check(0 < lo <= hi, "nnodes", value, "need 0 < MIN <= MAX")
    return lo, hi


def resolve_nproc(value: str) -> int:
    """An int, or cpu/gpu/xpu/auto resolved the way torchrun does (torch imported only then)."""
    n = int(value) if value.lstrip("-").isdigit() else _count_devices(value)
    _check(n >= 0, "nproc_per_node", value, "must be >= 1 (or 0 with --spares: a spare-only node)")
    return n


def _count_devices(kind: str) -> int:
    if kind == "cpu":
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    _check(kind in ("gpu", "xpu", "auto"), "nproc_per_node", kind, "expected an int or cpu, gpu, xpu, auto")
    import torch  # lazy: only device counting needs it

    if kind == "gpu":
        _check(torch.cuda.is_available(), "nproc_per_node", kind, "CUDA is not available")
        return int(torch.cuda.device_count())
    if kind == "xpu":
        _check(torch.xpu.is_available(), "nproc_per_node", kind, "XPU is not available")
        return int(torch.xpu.device_count())
    if torch.accelerator.is_available():
        return int(torch.accelerator.device_count())
    return _count_devices("cpu")


def parse_endpoint(value: str, default_port: int = DEFAULT_ETCD_PORT, field_name: str = "rdzv_endpoint",
                   ) -> Endpoint:
    """``host``, ``host:port``, ``[v6]:port`` or ``http://host:port`` -> Endpoint."""
    raw = value.strip()
    rest = (raw.split("://", 1)[1] if "://" in raw else raw).rstrip("/")
    port_s: str | None = None
    if rest.startswith("["):  # [v6] or [v6]:port
        host, sep, tail = rest[1:].partition("]")
        if not sep or (tail and not tail.startswith(":")):
            raise ConfigError(field_name, value, "malformed [IPv6]:PORT")
        port_s = tail[1:] if tail else None
    elif rest.count(":") == 1:
        host, port_s = rest.split(":")
    else:  # plain host, or a bare IPv6 address without a port
        host = rest
    _check(bool(host), field_name, value, "missing host")
    port = default_port
    if port_s is not None:
        try:
            port = int(port_s)
        except ValueError as exc:
            raise ConfigError(field_name, value, "port is not an integer") from exc
    _check(0 < port < 65536, field_name, value, "port must be in 1..65535")
    return Endpoint(host, port)


def parse_std(value: str, nproc: int, field_name: str) -> tuple[Std, ...]:
    """torchrun's ``--redirects``/``--tee`` syntax -> one Std per local rank."""
    if _VALUE_RE.match(value):
        return tuple(Std(int(value)) for _ in range(nproc))
    if _MAPPING_RE.match(value):
        per_rank = {int(k): Std(int(v)) for k, v in (m.split(":") for m in value.split(","))}
        return tuple(per_rank.get(i, Std.NONE) for i in range(nproc))
    raise ConfigError(field_name, value, "expected 0-3 or LOCAL_RANK:0-3,... (1=stdout, 2=stderr, 3=both)")


def parse_rdzv_conf(value: str) -> dict[str, str]:
    """``k=v,k2=v2`` -> dict (same rules as torch's _parse_rendezvous_config)."""
    out: dict[str, str] = {}
    if not value.strip():
        return out
    for kv in value.strip().split(","):
        key, _, val = kv.partition("=")
        _check(bool(key.strip() and val.strip()), "rdzv_conf", value, "expected <k1>=<v1>,...,<kN>=<vN>")
        out[key.strip()] = val.strip()
    return out


def _parse_signals(value: str) -> tuple[str, ...]:
    names = tuple(s.strip() for s in value.split(",") if s.strip())
    for name in names:
        _check(isinstance(getattr(signal, name, None), signal.Signals), "signals_to_handle", value,
               f"unknown signal {name!r}")
    return names


def _check(ok: bool, name: str, value: object, reason: str) -> None:
    if not ok:
        raise ConfigError(name, value, reason)
