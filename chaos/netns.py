"""Network namespaces for a local cluster: one namespace per node, a bridge, and partitions.

Why namespaces: a partition needs more than one network stack. Each node
(an agent and its workers) gets its own namespace with one veth into a
bridge in the root namespace; the bridge carries the root's address, where
etcd listens, and every node reaches every other node through it::

    root ns:  bridge ckb<tag> 10.A.B.1/24  (etcd, the chaos runner)
                 |-- ckh<tag><i> == veth == ckv0 in ns ckptless-<tag>-n<i>: 10.A.B.(10+i)/24

A partition is an nftables table in ONE node's namespace (both hooks, so
both directions of every existing connection are hit): cutting node<->etcd
leaves node<->node traffic alone and the reverse. Two modes: ``drop`` (a
black hole: peers see silence, TCP retransmits, and traffic resumes when the
table is deleted) and ``reset`` (TCP answered with RST: sockets fail at once).

Names derive from a 6-hex tag (interface names are at most 15 bytes). A state
file ``/run/ckptless-netns/<tag>.json`` records the owner pid; every new
topology first removes the namespaces, links and tables of tags whose owner
is dead (a crashed run), so nothing accumulates. Needs root, ``ip`` (iproute2)
and ``nft`` (Debian: ``apt-get install nftables``).
"""

from __future__ import annotations

import fcntl
import hashlib
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ckptless.errors import CkptlessError

STATE_DIR = Path("/run/ckptless-netns")
NS_PREFIX = "ckptless-"
BRIDGE_PREFIX = "ckb"
HOST_IF_PREFIX = "ckh"
NS_IF = "ckv0"  # the node's interface inside its namespace (same name in every namespace)
TABLE = "ckchaos"
_TAG_RE = re.compile(r"^[0-9a-f]{6}$")


class NetnsError(CkptlessError):
    """A namespace, link or firewall command failed (the message names the command)."""


def missing_tools() -> list[str]:
    """What this module needs and the machine lacks (empty: usable)."""
    missing = [t for t in ("ip", "nft") if shutil.which(t) is None]
    if os.geteuid() != 0:
        missing.append("root")
    return missing


def _run(cmd: Sequence[str], check: bool = True, timeout_s: float = 20.0) -> subprocess.CompletedProcess[str]:
    try:
        res = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"{' '.join(cmd)}: {exc}") from exc
    if check and res.returncode != 0:
        raise NetnsError(f"{' '.join(cmd)} exited {res.returncode}: {res.stderr.strip()}")
    return res


def _nft(ns: str, script: str) -> None:
    """Apply an nft script inside ``ns`` atomically (``nft -f -`` is one transaction)."""
    try:
        res = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=script, capture_output=True,
                             text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"nft in {ns}: {exc}") from exc
    if res.returncode != 0:
        raise NetnsError(f"nft in {ns} exited {res.returncode}: {res.stderr.strip()}\n{script}")


def tag_of(name: str) -> str:
    """A stable 6-hex tag for a cluster id (names of its namespaces and links derive from it)."""
    return hashlib.sha1(name.encode()).hexdigest()[:6]


@contextmanager
def _locked() -> Iterator[None]:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / "lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _live_tags() -> set[str]:
    live = set()
    for f in STATE_DIR.glob("*.json"):
        try:
            doc = json.loads(f.read_text())
            if _pid_alive(int(doc["pid"])):
                live.add(f.stem)
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return live


def _namespaces() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _links() -> list[str]:
    out = _run(["ip", "-o", "link", "show"], check=False).stdout
    return [m.group(1) for m in re.finditer(r"^\d+: ([^:@\s]+)", out, re.M)]


def _kill_ns_processes(ns: str) -> None:
    """SIGKILL what still runs in a namespace being removed (by pid, as ``ip netns pids`` lists them)."""
    for line in _run(["ip", "netns", "pids", ns], check=False).stdout.split():
        if line.isdigit() and int(line) != os.getpid():
            try:
                os.kill(int(line), signal.SIGKILL)
            except ProcessLookupError:
                pass


def remove_tag(tag: str) -> list[str]:
    """Delete every namespace, link and the state file of ``tag``; return what was removed."""
    removed = []
    for ns in _namespaces():
        if ns.startswith(f"{NS_PREFIX}{tag}-"):
            _kill_ns_processes(ns)
            _run(["ip", "netns", "del", ns], check=False)  # its veth end goes, and with it the peer
            removed.append(ns)
    for link in _links():
        if link == f"{BRIDGE_PREFIX}{tag}" or link.startswith(f"{HOST_IF_PREFIX}{tag}"):
            _run(["ip", "link", "del", link], check=False)
            removed.append(link)
    try:
        (STATE_DIR / f"{tag}.json").unlink()
    except FileNotFoundError:
        pass
    return removed


def cleanup_stale() -> list[str]:
    """Remove the resources of every tag whose owner process is gone (a crashed or killed run)."""
    live = _live_tags()
    tags = set()
    for ns in _namespaces():
        if ns.startswith(NS_PREFIX):
            tags.add(ns[len(NS_PREFIX):].split("-")[0])
    for link in _links():
        for prefix in (BRIDGE_PREFIX, HOST_IF_PREFIX):
            if link.startswith(prefix) and _TAG_RE.match(link[len(prefix):len(prefix) + 6]):
                tags.add(link[len(prefix):len(prefix) + 6])
    tags |= {f.stem for f in STATE_DIR.glob("*.json")}
    removed: list[str] = []
    for tag in sorted(t for t in tags if _TAG_RE.match(t) and t not in live):
        removed += remove_tag(tag)
    return removed


def _used_networks() -> list[ipaddress.IPv4Network]:
    out = _run(["ip", "-4", "-o", "addr", "show"], check=False).stdout
    nets = [ipaddress.IPv4Interface(m.group(1)).network for m in re.finditer(r"inet (\S+)", out)]
    out = _run(["ip", "-4", "route", "show"], check=False).stdout
    for line in out.splitlines():
        first = line.split()[0] if line.split() else ""
        if first and first != "default":
            try:
                nets.append(ipaddress.IPv4Network(first, strict=False))
            except ValueError:
                continue
    return nets


def _pick_subnet(tag: str) -> ipaddress.IPv4Network:
    """A /24 in 10.200.0.0/13 derived from the tag, moved on past any network already in use."""
    used = _used_networks()
    start = int(tag, 16) % 2048
    for k in range(2048):
        n = (start + k) % 2048
        net = ipaddress.IPv4Network(f"10.{200 + n // 256}.{n % 256}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise NetnsError("no free /24 in 10.200.0.0/13 for the chaos bridge")


@dataclass(frozen=True)
class NodeNet:
    index: int
    ns: str
    ip: str
    host_if: str

    def exec_prefix(self) -> list[str]:
        """Prefix for a command that must run inside this node's namespace."""
        return ["ip", "netns", "exec", self.ns]


@dataclass(frozen=True)
class Partition:
    """One active cut: an nft table in ``node``'s namespace; ``heal()`` deletes it."""

    node: NodeNet
    table: str
    what: str
    mode: str

    def heal(self) -> None:
        _run(["ip", "netns", "exec", self.node.ns, "nft", "delete", "table", "inet", self.table], check=False)


class NetTopology:
    """Bridge + one namespace per node. ``create()`` then ``close()`` (idempotent, also after a crash)."""

    def __init__(self, name: str, nodes: int) -> None:
        if nodes < 1:
            raise NetnsError(f"a topology needs >= 1 node, got {nodes}")
        self.tag = tag_of(name)
        self.bridge = f"{BRIDGE_PREFIX}{self.tag}"
        self.count = nodes
        self.nodes: list[NodeNet] = []
        self.root_ip = ""
        self._subnet: ipaddress.IPv4Network | None = None
        self._cuts = 0

    def create(self) -> NetTopology:
        missing = missing_tools()
        if missing:
            raise NetnsError(f"network namespaces need {', '.join(missing)} (Debian: apt-get install iproute2 "
                             "nftables; run as root)")
        with _locked():
            cleanup_stale()
            remove_tag(self.tag)  # our own leftovers, if a run with the same name crashed
            (STATE_DIR / f"{self.tag}.json").write_text(json.dumps({"pid": os.getpid(), "nodes": self.count}))
            self._subnet = net = _pick_subnet(self.tag)
            hosts = list(net.hosts())
            self.root_ip = str(hosts[0])
            try:
                self._build([str(hosts[9 + i]) for i in range(self.count)], net.prefixlen)
            except NetnsError:
                remove_tag(self.tag)
                raise
        return self

    def _build(self, ips: list[str], prefix: int) -> None:
        br = self.bridge
        _run(["ip", "link", "add", br, "type", "bridge", "forward_delay", "0", "stp_state", "0"])
        _run(["ip", "addr", "add", f"{self.root_ip}/{prefix}", "dev", br])
        _run(["ip", "link", "set", br, "up"])
        for i, ip in enumerate(ips):
            node = NodeNet(i, f"{NS_PREFIX}{self.tag}-n{i}", ip, f"{HOST_IF_PREFIX}{self.tag}{i}")
            peer = f"ckp{self.tag}{i}"
            _run(["ip", "netns", "add", node.ns])
            _run(["ip", "link", "add", node.host_if, "type", "veth", "peer", "name", peer])
            _run(["ip", "link", "set", peer, "netns", node.ns])
            _run(["ip", "-n", node.ns, "link", "set", peer, "name", NS_IF])
            _run(["ip", "-n", node.ns, "addr", "add", f"{ip}/{prefix}", "dev", NS_IF])
            _run(["ip", "-n", node.ns, "link", "set", NS_IF, "up"])
            _run(["ip", "-n", node.ns, "link", "set", "lo", "up"])
            _run(["ip", "link", "set", node.host_if, "master", br])
            _run(["ip", "link", "set", node.host_if, "up"])
            self.nodes.append(node)

    def close(self) -> None:
        with _locked():
            remove_tag(self.tag)
        self.nodes = []

    def __enter__(self) -> NetTopology:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- partitions -----------------------------------------------------------------------------
    def _cut(self, node: NodeNet, matches: list[tuple[str, str]], what: str, mode: str,
             keep: Sequence[str] = ()) -> Partition:
        """``matches``: (output match, input match) pairs; every matching packet is dropped/reset,
        except packets matching one of ``keep`` (whole nft rule bodies, accepted first)."""
        if mode not in ("drop", "reset"):
            raise NetnsError(f"partition mode must be drop or reset, not {mode!r}")
        self._cuts += 1
        table = f"{TABLE}{self._cuts}"
        verdict = "drop" if mode == "drop" else "reject with tcp reset"
        rules = []
        if mode == "reset":
            # The RSTs that reject itself generates must pass: to a local socket they come back
            # through lo (with the peer's address as source), to the peer through the output hook.
            rules += [f"add rule inet {table} in iifname \"lo\" accept",
                      f"add rule inet {table} out tcp flags & rst == rst accept"]
        rules += [f"add rule inet {table} {body} accept" for body in keep]
        for out_match, in_match in matches:
            for chain, m in (("out", out_match), ("in", in_match)):
                if mode == "reset":  # RST for TCP, then drop anything else (UDP has no connection to reset)
                    rules.append(f"add rule inet {table} {chain} {m} meta l4proto tcp {verdict}")
                rules.append(f"add rule inet {table} {chain} {m} drop")
        script = "\n".join([
            f"add table inet {table}",
            f"add chain inet {table} out {{ type filter hook output priority -10 ; }}",
            f"add chain inet {table} in {{ type filter hook input priority -10 ; }}",
            *rules, ""])
        _nft(node.ns, script)
        return Partition(node, table, what, mode)

    def cut_from_root(self, index: int, port: int | None = None, mode: str = "drop") -> Partition:
        """Cut node ``index`` from the root namespace's address (etcd), only ``port`` if given.

        Node<->node traffic does not touch the root's address, so it stays intact.
        """
        node = self.nodes[index]
        port_out = f" tcp dport {port}" if port else ""
        port_in = f" tcp sport {port}" if port else ""
        return self._cut(node, [(f"ip daddr {self.root_ip}{port_out}", f"ip saddr {self.root_ip}{port_in}")],
                         f"node {index} <-> {self.root_ip}{':' + str(port) if port else ''}", mode)

    def cut_between(self, a: int, b: int, mode: str = "reset", keep_ports: Sequence[int] = ()) -> Partition:
        """Cut every packet between nodes ``a`` and ``b`` (both still reach the root/etcd).

        ``keep_ports``: TCP ports (a server on either node) whose connections stay up,
        e.g. the agents' store: then only worker<->worker traffic is cut.
        """
        if a == b:
            raise NetnsError(f"cannot partition node {a} from itself")
        other = self.nodes[b].ip
        keep = []
        for port in keep_ports:
            keep += [f"out ip daddr {other} tcp dport {port}", f"out ip daddr {other} tcp sport {port}",
                     f"in ip saddr {other} tcp sport {port}", f"in ip saddr {other} tcp dport {port}"]
        what = f"node {a} <-> node {b}" + (f" except tcp port {','.join(map(str, keep_ports))}" if keep_ports else "")
        return self._cut(self.nodes[a], [(f"ip daddr {other}", f"ip saddr {other}")], what, mode, keep)

    def rules(self, index: int) -> str:
        """The node's current nft ruleset (for logs and tests)."""
        return _run(["ip", "netns", "exec", self.nodes[index].ns, "nft", "list", "ruleset"], check=False).stdout


def probe(ns: str | None, host: str, port: int, timeout_s: float = 1.0) -> str:
    """Try one TCP connect from ``ns`` (None: the root namespace): ``ok``, ``refused`` or ``timeout``.

    Runs a tiny Python in the namespace (``ping`` is not always installed and ICMP
    is not what the job uses).
    """
    code = ("import socket,sys\n"
            f"s=socket.socket(); s.settimeout({timeout_s})\n"
            f"try: s.connect(({host!r},{port})); print('ok')\n"
            "except socket.timeout: print('timeout')\n"
            "except OSError: print('refused')\n")
    cmd = ["python3", "-c", code]
    if ns is not None:
        cmd = ["ip", "netns", "exec", ns, *cmd]
    return _run(cmd, check=False, timeout_s=timeout_s + 20).stdout.strip() or "error"
