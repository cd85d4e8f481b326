"""The agent's check of the network its mirrors use (:mod:`ckptless.mirror.link`): named at start, measured once.

Why in the agent: it knows the address its workers' Gloo binds (``--local-addr``,
``GLOO_SOCKET_IFNAME``) and, after the rendezvous, its peer nodes; one probe per
node (not per worker) measures the link every rank's replicas cross. What it
found goes to ``links/<node-id>`` (``ckptless status``), a gauge
(``ckptless_mirror_link_bits_per_second``), the goodput dir (``ckptless report``)
and, as a warning on stderr, when the interface is not the collectives' or the
rate is below ``CKPTLESS_MIRROR_MIN_GBPS``. Telemetry: nothing here fails or
delays the job (the probe runs on its own thread, every step has a deadline).

Cost in W: per node one TCP connection to one peer for ~0.3 s, one etcd put at
start, one after the probe and one per lease renewal; nothing per worker, nothing on the leader.
"""

from __future__ import annotations

import json
import logging
import socket
import sys
import threading
from typing import Any

from ckptless import environment
from ckptless.coordinator import EtcdClient
from ckptless.coordinator import Keyspace
from ckptless.coordinator import RendezvousResult
from ckptless.goodput import EventKind
from ckptless.metrics import MetricsExporter
from ckptless.mirror import MirrorLink, ProbeServer, collectives_interface, interfaces, judge, probe, resolve
from ckptless.worker import WorkerLedger

log = logging.getLogger(__name__)

PROBE_S = 0.3


class LinkCheck:
    """Publish at start (:meth:`publish`), measure after the rendezvous (:meth:`measure`), publish again
    under a new lease (:meth:`republish`: the key lives on the agent's lease), :meth:`close`."""

    def __init__(self, client: EtcdClient, keyspace: Keyspace, node_id: str, local_addr: str | None,
                 uses_nccl: bool, metrics: MetricsExporter | None, goodput_dir: str | None) -> None:
        self.client, self.keyspace, self.node_id = client, keyspace, node_id
        self.local_addr, self.uses_nccl = local_addr, uses_nccl
        self.metrics, self.goodput_dir = metrics, goodput_dir
        self.link: MirrorLink | None = None
        self._server: ProbeServer | None = None
        self._ifaces: dict[str, str] = {}
        self._thread: threading.Thread | None = None
        self._lease: int | None = None
        self._doc: dict[str, Any] | None = None  # what links/<node> holds: published again on a new lease
        self._lock = threading.Lock()  # the probe's thread and a renewal both put the key

    def publish(self, lease: int | None) -> None:
        """Name the mirrors' interface and address and open the probe port (never raises)."""
        self._lease = lease
        try:
            env = environment.current()
            self._ifaces = interfaces()
            try:
                host_address = socket.gethostbyname(socket.gethostname())
            except OSError:
                host_address = "?"
            iface, addr, how = resolve(env.gloo_socket_ifname, self.local_addr, host_address, self._ifaces)
            self.link = MirrorLink(iface, addr, how)
            doc: dict[str, Any] = self.link.to_json()
            if addr != "?":
                self._server = ProbeServer(addr)
                doc["probe_port"] = self._server.port
            self._put(doc)
        except Exception as exc:  # noqa: BLE001 - telemetry: the job goes on without it
            log.warning("mirror link not stated: %s", exc)

    def republish(self, lease: int | None) -> None:
        """The agent's lease was renewed: its keys went with the old one; put ``links/<node>`` back (never raises)."""
        try:
            with self._lock:  # the document read under the lock: the probe's report may be being put
                self._lease = lease
                if self._doc is not None:
                    self.client.put(self.keyspace.link(self.node_id), json.dumps(self._doc), lease=lease)
        except Exception as exc:  # noqa: BLE001 - telemetry
            log.warning("mirror link not published again: %s", exc)

    def _put(self, doc: dict[str, Any]) -> None:
        with self._lock:
            self._doc = doc
            self.client.put(self.keyspace.link(self.node_id), json.dumps(doc), lease=self._lease)

    def measure(self, result: RendezvousResult) -> None:
        """Probe the next node of the rendezvous (this node alone: itself) on a thread of its own."""
        if self.link is None or not result.participants:
            return
        ids = [p.node_id for p in result.participants]
        me = ids.index(self.node_id) if self.node_id in ids else 0
        peer = ids[(me + 1) % len(ids)]
        self._thread = threading.Thread(target=self._measure, args=(peer,), name="ckptless-link", daemon=True)
        self._thread.start()

    def _measure(self, peer: str) -> None:
        assert self.link is not None
        link = self.link
        try:
            kv = self.client.get(self.keyspace.link(peer), timeout_s=5.0)
            doc = json.loads(kv.value) if kv is not None else {}
            port = doc.get("probe_port")
            if not isinstance(port, int):
                raise ConnectionError(f"node {peer} published no probe port")
            rate, secs = probe(str(doc["address"]), port, seconds=PROBE_S)
            link = MirrorLink(link.interface, link.address, link.chosen_by, peer, rate, secs)
        except Exception as exc:  # noqa: BLE001 - telemetry
            link = MirrorLink(link.interface, link.address, link.chosen_by, peer, error=f"not measured: {exc}"[:200])
        self.link = link
        self._report(link)

    def _report(self, link: MirrorLink) -> None:
        env = environment.current()
        collectives = collectives_interface(self.uses_nccl, env.nccl_socket_ifname, link.interface, self._ifaces)
        for warning in judge(link, collectives, env.mirror_min_gbps):
            print(f"ckptless-run: warning: {warning}", file=sys.stderr, flush=True)
        print(f"ckptless-run: mirrors on {link.describe()}", file=sys.stderr, flush=True)
        try:
            self._put({**link.to_json(), "collectives_interface": collectives})
        except Exception as exc:  # noqa: BLE001 - telemetry
            log.warning("mirror link not published: %s", exc)
        if self.metrics is not None and link.bytes_per_s is not None:
            self.metrics.set_mirror_link(link.interface or "?", link.peer or "?", link.bytes_per_s * 8)
        if self.goodput_dir:
            try:
                ledger = WorkerLedger(self.goodput_dir, None, name=f"link-{self.node_id}")
                ledger.emit(EventKind.MIRROR_LINK, None, 0, None, True, node=self.node_id,
                            interface=link.interface or "?", address=link.address, chosen_by=link.chosen_by,
                            peer=link.peer or "", error=link.error, bits_per_s=(link.bytes_per_s or 0.0) * 8)
                ledger.close()
            except Exception as exc:  # noqa: BLE001 - telemetry
                log.warning("mirror link not recorded: %s", exc)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=1.0)  # a daemon thread: a probe still running does not hold the exit
        if self._server is not None:
            self._server.close()
