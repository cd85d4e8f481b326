"""``ckptless status``: a running job as etcd sees it (read-only).

Why from etcd and not from the agents: etcd is the one place that holds the
whole job (every node, the leader, the membership the leader published), it
is reachable from anywhere the agents are, and reading it changes nothing:
this module issues only ``get`` and ``get_prefix`` calls, through the same
:class:`~ckptless.coordinator.keyspace.Keyspace` and wire decoders the agents
and the leader use, so it cannot drift from what they write.

The committed step is not in etcd (the mirrors commit over the training
process group, not through etcd), so it is shown as ``unknown``; where the
last incident's survivors reported their committed version (``facts/g<G>/``),
that figure is shown with its generation, clearly as a past value.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from typing import IO, Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from ckptless.coordinator import EtcdClient
from ckptless.coordinator import EtcdConfig
from ckptless.coordinator import Keyspace
from ckptless.errors import CkptlessError, CoordinatorError
from ckptless.mirror import MirrorLink
from ckptless.recovery import membership_from_json, report_from_json, spare_from_json

@dataclass(frozen=True)
class Member:
    rank: int
    worker_id: str
    node_id: str
    source: str


@dataclass(frozen=True)
class JobStatus:
    job_id: str
    endpoint: str
    revision: int
    generation: int | None
    generation_reason: str
    state: str
    state_reason: str
    world_size: int | None
    members: tuple[Member, ...]
    spares: tuple[tuple[str, str], ...]
    leader: str | None
    leader_key: str | None
    contenders: int
    nodes: tuple[dict[str, Any], ...]
    last_decision: str | None
    incidents: tuple[tuple[int, str], ...]
    committed_step: int | None = None
    committed_note: str = "not stored in etcd"
    problems: tuple[str, ...] = field(default=())
    waiting: str = ""  # the job holds for a replacement (the leader's note on the open incident), or ""
    fewer: str = ""  # the job runs with fewer processes than ranks (--lost-node shrink), or ""


def _config(endpoint: str, timeout_s: float) -> EtcdConfig:
    """The agents' own connection rule (endpoints plus ``CKPTLESS_ETCD_*`` credentials), with our timeouts."""
    return replace(EtcdConfig.from_env(endpoint), connect_timeout_s=timeout_s, call_deadline_s=timeout_s,
                   request_timeout_s=min(2.0, timeout_s))


def read_status(endpoint: str, job_id: str, timeout_s: float = 5.0) -> JobStatus:
    """Everything ``ckptless status`` shows, read with get/get_prefix only."""
    ks = Keyspace(job_id)
    with EtcdClient(_config(endpoint, timeout_s)) as c:
        return _read(c, ks, endpoint)


def _read(c: EtcdClient, ks: Keyspace, endpoint: str) -> JobStatus:
    problems: list[str] = []
    everything, revision = c.get_prefix(ks.prefix)
    if not everything:
        raise CoordinatorError(f"no keys under {ks.prefix} at {endpoint}: no job {ks.job_id!r} "
                               "(check --rdzv-id and --rdzv-endpoint)")
    gen, gen_reason = None, ""
    kv = c.get(ks.generation)
    if kv is not None:
        try:
            doc = json.loads(kv.value)
            gen, gen_reason = int(doc["generation"]), str(doc.get("reason", ""))
        except (ValueError, KeyError, TypeError):
            problems.append(f"malformed {ks.generation}")
    members: tuple[Member, ...] = ()
    world, decision, fewer = None, None, ""
    kv = c.get(ks.membership)
    if kv is not None:
        try:
            m = membership_from_json(kv.value)
            members = tuple(Member(a.rank, a.worker_id, a.node_id, a.source) for a in sorted(m.ranks, key=lambda a: a.rank))
            world = m.world_size
            decision = None if m.decision is None else type(m.decision).__name__
            if m.hosted:
                processes = m.world_size - len(m.hosted)
                fewer = (f"running {m.world_size} ranks on {processes} processes: ranks {sorted(m.hosted)} hosted "
                         "by survivors (--lost-node shrink; it grows back when a spare is at hand for each)")
        except CkptlessError as exc:
            problems.append(str(exc))
    spares = []
    for s in c.get_prefix(ks.spares_prefix)[0]:
        try:
            w = spare_from_json(s.value)
            spares.append((w.worker_id, w.node_id))
        except (ValueError, KeyError, TypeError):
            problems.append(f"malformed spare record {s.key}")
    contenders = sorted(c.get_prefix(ks.election_prefix)[0], key=lambda k: k.create_revision)
    leader = contenders[0] if contenders else None
    nodes = []
    for n in c.get_prefix(ks.nodes_prefix)[0]:
        try:
            nodes.append(dict(json.loads(n.value)))
        except (ValueError, TypeError):
            problems.append(f"malformed node record {n.key}")
    links = {}
    for k in c.get_prefix(ks.links_prefix)[0]:
        try:
            links[k.key.rsplit("/", 1)[-1]] = MirrorLink.from_json(json.loads(k.value)).describe()
        except (ValueError, KeyError, TypeError):
            problems.append(f"malformed mirror link record {k.key}")
    for node in nodes:
        node["mirrors"] = links.get(str(node.get("node_id", "")), "not stated")
    state, state_reason = ("running" if nodes or contenders else "no live agents"), ""
    kv = c.get(ks.status)
    if kv is not None:
        try:
            doc = json.loads(kv.value)
            state, state_reason = str(doc.get("state", "?")), str(doc.get("reason", ""))
        except (ValueError, TypeError, AttributeError):
            problems.append(f"malformed {ks.status}")
    incidents = []
    waiting = ""
    for i in c.get_prefix(ks.incident_prefix)[0]:
        g = ks.incident_generation(i.key)
        try:
            doc = json.loads(i.value)
            lost = ",".join(str(r) for r in doc.get("lost", []))
            if g is not None and g == gen and isinstance(doc.get("waiting"), dict):  # still the open incident
                waiting = _waiting(doc["waiting"])
        except (ValueError, TypeError, AttributeError):
            lost = "?"
        if g is not None:
            incidents.append((g, lost))
    incidents.sort()
    note = "not stored in etcd"
    if incidents:  # the newest incident's survivors reported the version they had committed
        g = incidents[-1][0]
        committed = []
        for f in c.get_prefix(ks.facts_prefix(g))[0]:
            try:
                r = report_from_json(f.value)
            except CkptlessError:
                continue
            if r.committed is not None:
                committed.append(r.committed)
        if committed:
            note = (f"not stored in etcd; it was {min(committed)} when generation {g} failed "
                    f"(survivors' reports, facts/g{g}/)")
    return JobStatus(ks.job_id, endpoint, revision, gen, gen_reason, state, state_reason, world, members,
                     tuple(sorted(spares)), None if leader is None else leader.value.decode(errors="replace"),
                     None if leader is None else leader.key.rsplit("/", 1)[-1], len(contenders),
                     tuple(sorted(nodes, key=lambda d: str(d.get("node_id", "")))), decision, tuple(incidents),
                     None, note, tuple(problems), waiting, fewer)


def _waiting(w: dict[str, Any]) -> str:
    """The leader's note that the job waits for a replacement, in words."""
    def at(t: Any) -> str:
        return time.strftime("%H:%M:%S UTC", time.gmtime(float(t))) if isinstance(t, (int, float)) else "?"

    ranks = w.get("ranks", [])
    return (f"waiting for a replacement for ranks {ranks} since {at(w.get('since'))}, until {at(w.get('until'))} "
            f"(--replacement-timeout): {w.get('reason', '')}")


def status_to_json(s: JobStatus) -> dict[str, Any]:
    return {
        "job_id": s.job_id, "endpoint": s.endpoint, "etcd_revision": s.revision, "generation": s.generation,
        "generation_reason": s.generation_reason, "state": s.state, "state_reason": s.state_reason,
        "world_size": s.world_size,
        "members": [{"rank": m.rank, "worker_id": m.worker_id, "node_id": m.node_id, "source": m.source}
                    for m in s.members],
        "spares": [{"worker_id": w, "node_id": n} for w, n in s.spares],
        "leader": s.leader, "leader_key": s.leader_key, "election_contenders": s.contenders,
        "nodes": list(s.nodes), "last_decision": s.last_decision,
        "incidents": [{"generation": g, "lost": lost} for g, lost in s.incidents],
        "committed_step": s.committed_step, "committed_note": s.committed_note, "problems": list(s.problems),
        "waiting": s.waiting, "fewer": s.fewer,
    }


def render_status(s: JobStatus, file: IO[str] | None = None) -> None:
    console = Console(file=file, highlight=False, width=max(Console(file=file).width, 100))
    head = Text()
    head.append(f"job {s.job_id}", style="bold")
    head.append(f"  at {s.endpoint} (etcd revision {s.revision})\n")
    head.append("state ", style="bold")
    head.append(s.state, style="green" if s.state in ("running", "succeeded") else "red")
    if s.state_reason:
        head.append(f" ({s.state_reason})")
    head.append(f"   generation {'?' if s.generation is None else s.generation}")
    if s.generation_reason:
        head.append(f" ({s.generation_reason})")
    head.append(f"   world size {'?' if s.world_size is None else s.world_size}\n")
    head.append(f"leader {s.leader or 'none'}" + (f" (election key {s.leader_key}, {s.contenders} contender(s))"
                                                  if s.leader_key else "") + "\n")
    head.append(f"committed step {'unknown' if s.committed_step is None else s.committed_step}")
    if s.committed_note and s.committed_step is None:
        head.append(f" ({s.committed_note})", style="dim")
    if s.incidents:
        head.append("\nincidents: " + ", ".join(f"generation {g} failed (lost {lost or '?'})" for g, lost in s.incidents))
    if s.waiting:
        head.append("\n" + s.waiting, style="yellow")
    if s.fewer:
        head.append("\n" + s.fewer, style="yellow")
    console.print(head)
    t = Table(title="members", title_justify="left", header_style="bold", show_edge=False)
    for h in ("rank", "worker id", "node", "source"):
        t.add_column(h, no_wrap=True, justify="right" if h == "rank" else "left")
    for m in s.members:
        t.add_row(str(m.rank), m.worker_id, m.node_id, m.source)
    console.print(t)
    sp = Table(title=f"spares ({len(s.spares)} free)", title_justify="left", header_style="bold", show_edge=False)
    sp.add_column("worker id", no_wrap=True)
    sp.add_column("node", no_wrap=True)
    for w, n in s.spares:
        sp.add_row(w, n)
    console.print(sp)
    nt = Table(title=f"nodes ({len(s.nodes)} live)", title_justify="left", header_style="bold", show_edge=False)
    for h in ("node", "host", "workers", "store port", "mirrors"):
        nt.add_column(h, no_wrap=h != "mirrors")
    for node in s.nodes:
        nt.add_row(*(str(node.get(k, "?")) for k in ("node_id", "host", "nproc", "store_port", "mirrors")))
    console.print(nt)
    for p in s.problems:
        console.print(Text(f"warning: {p}", style="yellow"))
