"""The node agent's Prometheus gauges, from its workers' heartbeat records and the recovery timeline.

Why from heartbeat files: progress (committed version, newest step, replica
bytes held) is node-local, so exporting it costs no etcd write.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ckptless.launcher.slots import Slot
from ckptless.metrics import MetricsExporter
from ckptless.recovery import Membership
from ckptless.worker import read_progress


def update_node_metrics(mx: MetricsExporter, slots: Sequence[Slot], membership: Membership | None,
                        incident_t: Mapping[int, float], published_t: Mapping[int, float]) -> None:
    """Set the gauges: committed version (min over this node's ranks), mirror lag, replica bytes held,
    own image bytes, free spares, and the last recovery's decision time (incident opened -> plan published)."""
    committed, newest, held, own = None, None, 0, 0
    for slot in slots:
        doc = read_progress(slot.heartbeat_file) if slot.alive and slot.rank is not None else None
        if doc is None:
            continue
        c, s = doc.get("committed"), doc.get("step")
        if isinstance(c, int):
            committed = c if committed is None else min(committed, c)
        if isinstance(s, int):
            newest = s if newest is None else max(newest, s)
        b, o = doc.get("replica_bytes"), doc.get("own_bytes")
        held += b if isinstance(b, int) else 0
        own += o if isinstance(o, int) else 0
    if committed is not None:
        mx.set_committed_version(committed)
        if newest is not None:
            mx.set_mirror_lag(max(0, newest - committed))
    mx.set_replica_bytes(held)
    mx.set_own_image_bytes(own)
    mx.set_spares_free(sum(1 for s in slots if s.spare and s.alive))
    m = membership
    if m is not None and m.decision is not None and m.generation - 1 in incident_t:
        t0 = incident_t[m.generation - 1]
        t1 = published_t.get(m.generation, t0)
        mx.set_last_recovery({"decision": t1 - t0})
