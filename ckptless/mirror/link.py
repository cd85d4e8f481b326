"""Which network the mirrors use, and how fast it is: stated at start, measured once.

Why: every replica of every rank's state crosses this network at each mirror
round and again at a recovery, and nothing used to say which one it was. Gloo
binds the interface ``GLOO_SOCKET_IFNAME`` names, else ``--local-addr``
(:func:`ckptless.worker.rebindable.new_gloo`), else the address the host name
resolves to: on a cluster with a fast fabric and a front-end Ethernet, that is
easily the slow one (a TorchFT user's recovery took 948 s that way,
torchft#329). So each agent names the interface and address, measures the
rate to one peer agent for a few hundred milliseconds, and warns when the
interface is not the one the job's collectives use or the rate is below
``CKPTLESS_MIRROR_MIN_GBPS``.

Pure decisions (:func:`resolve`, :func:`collectives_interface`, :func:`judge`)
are apart from the I/O (:func:`interfaces`, :class:`ProbeServer`,
:func:`probe`), which uses plain TCP sockets with deadlines.
"""

from __future__ import annotations

import fcntl
import socket
import struct
import threading
import time
from dataclasses import dataclass

__all__ = ["MirrorLink", "ProbeServer", "collectives_interface", "interfaces", "judge", "probe", "resolve"]

_SIOCGIFADDR = 0x8915
_CHUNK = 1 << 20


@dataclass(frozen=True)
class MirrorLink:
    """What an agent found: the mirrors' interface and address (and what chose them), the peer it
    measured and the rate (None before the probe or when it failed, with ``error``)."""

    interface: str | None
    address: str
    chosen_by: str
    peer: str | None = None
    bytes_per_s: float | None = None
    probe_s: float | None = None
    error: str = ""

    def to_json(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if v not in (None, "")}

    @classmethod
    def from_json(cls, doc: dict[str, object]) -> MirrorLink:
        rate, secs = doc.get("bytes_per_s"), doc.get("probe_s")
        return cls(interface=str(doc["interface"]) if doc.get("interface") else None, address=str(doc["address"]),
                   chosen_by=str(doc.get("chosen_by", "")), peer=str(doc["peer"]) if doc.get("peer") else None,
                   bytes_per_s=float(rate) if isinstance(rate, (int, float)) else None,
                   probe_s=float(secs) if isinstance(secs, (int, float)) else None, error=str(doc.get("error", "")))

    def describe(self) -> str:
        where = f"{self.interface or '?'} {self.address} (chosen by {self.chosen_by})"
        if self.bytes_per_s is not None:
            return f"{where}: {self.bytes_per_s * 8 / 1e9:.2f} Gb/s to {self.peer}"
        return f"{where}: {self.error or 'not measured yet'}"


# --- pure decisions ----------------------------------------------------------------------------------
def resolve(gloo_ifname: str | None, local_addr: str | None, host_address: str,
            ifaces: dict[str, str]) -> tuple[str | None, str, str]:
    """(interface, address, what chose it) as Gloo binds: ``GLOO_SOCKET_IFNAME`` first (its first
    name), then ``--local-addr``, then the host name's address."""
    if gloo_ifname:
        name = gloo_ifname.split(",")[0].strip()
        return name, ifaces.get(name, "?"), "GLOO_SOCKET_IFNAME"
    addr, how = (local_addr, "--local-addr") if local_addr else (host_address, "the host name")
    owner = next((n for n, a in sorted(ifaces.items()) if a == addr), None)
    return owner, addr, how


def _nccl_matches(name: str, spec: str) -> bool:
    """NCCL_SOCKET_IFNAME's rule: comma-separated prefixes; ``^`` excludes them; ``=`` means exact."""
    exclude = spec.startswith("^")
    spec = spec.lstrip("^")
    exact = spec.startswith("=")
    names = [p.strip() for p in spec.lstrip("=").split(",") if p.strip()]
    hit = any(name == p if exact else name.startswith(p) for p in names)
    return hit != exclude


def collectives_interface(uses_nccl: bool, nccl_ifname: str | None, mirror_interface: str | None,
                          ifaces: dict[str, str]) -> str | None:
    """The interface the job's own collectives use, as far as it can be told without running them.

    CPU tensors go through Gloo, bound like the mirrors: the same interface. NCCL's socket transport
    takes ``NCCL_SOCKET_IFNAME`` (prefixes) or, by default, an ``ib*`` interface before any other
    that is not loopback or ``docker*``. (NCCL over InfiniBand verbs uses no IP interface at all; its
    IP-over-IB interface is the nearest one the mirrors can use.) ``ifaces`` in the system's order
    (:func:`interfaces`), which is the order NCCL walks."""
    if not uses_nccl:
        return mirror_interface
    names = list(ifaces)
    if nccl_ifname:
        return next((n for n in names if _nccl_matches(n, nccl_ifname)), None)
    usable = [n for n in names if n != "lo" and not n.startswith("docker")]
    return next((n for n in usable if n.startswith("ib")), usable[0] if usable else None)


def judge(link: MirrorLink, collectives: str | None, min_gbps: float) -> list[str]:
    """The warnings an agent prints (empty: nothing to say)."""
    out = []
    if collectives is not None and link.interface is not None and link.interface != collectives:
        out.append(f"the mirrors use {link.interface} ({link.address}, chosen by {link.chosen_by}) but the job's "
                   f"collectives use {collectives}: every replica crosses the other network; pin the mirrors with "
                   f"--local-addr <an address of {collectives}> or GLOO_SOCKET_IFNAME={collectives}")
    if link.bytes_per_s is not None and link.bytes_per_s * 8 / 1e9 < min_gbps:
        out.append(f"the mirrors' link {link.interface or '?'} ({link.address}) to {link.peer} carries "
                   f"{link.bytes_per_s * 8 / 1e9:.2f} Gb/s, below CKPTLESS_MIRROR_MIN_GBPS={min_gbps:g}: mirror rounds "
                   f"and recoveries will be slow (docs/configuration.md, --local-addr)")
    return out


# --- I/O ---------------------------------------------------------------------------------------------
def interfaces() -> dict[str, str]:
    """This host's interfaces with an IPv4 address, in the system's order (Linux ioctl; an interface
    without one is left out)."""
    out: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            out[name] = socket.inet_ntoa(packed[20:24])
    return out


class ProbeServer:
    """Accepts probe connections on ``address`` (a thread): reads to EOF, answers the byte count."""

    def __init__(self, address: str, timeout_s: float = 10.0) -> None:
        self._sock = socket.create_server((address, 0))
        self._sock.settimeout(0.5)
        self.port = int(self._sock.getsockname()[1])
        self._timeout_s = timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="ckptless-link-probe", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except (TimeoutError, OSError):
                continue
            with conn:
                conn.settimeout(self._timeout_s)
                n = 0
                try:
                    while chunk := conn.recv(_CHUNK):
                        n += len(chunk)
                    conn.sendall(struct.pack("!Q", n))
                except OSError:
                    continue

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(timeout=2.0)


def probe(address: str, port: int, seconds: float = 0.3, max_bytes: int = 1 << 30,
          timeout_s: float = 10.0) -> tuple[float, float]:
    """(bytes/s, seconds): send for ``seconds`` (at most ``max_bytes``), counted by the receiver."""
    payload = bytes(_CHUNK)
    with socket.create_connection((address, port), timeout=timeout_s) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        t0 = time.perf_counter()
        sent = 0
        while sent < max_bytes and time.perf_counter() - t0 < seconds:
            s.sendall(payload)
            sent += len(payload)
        s.shutdown(socket.SHUT_WR)
        got = b""
        while len(got) < 8:
            part = s.recv(8 - len(got))
            if not part:
                raise ConnectionError("the probe's receiver closed without a count")
            got += part
        elapsed = time.perf_counter() - t0
    (received,) = struct.unpack("!Q", got)
    return received / elapsed, elapsed
