"""Which copy of a replica set is right, decided by evidence (issue 35): the verdict, and the bounded
summary that carries the evidence up a tree to every member (pure).

Why: each rank used to judge from its two ring neighbours alone, so when two ranks held the same wrong
bytes (a bad node: the same bit flipped on both of its ranks) every rank named a different "odd one",
or none left and the version could never commit; and a rank replaced for corruption that showed it
again was replaced again, without end. Here every member of the set decides from the same facts: how
many compared copies are equal to each other, on which nodes, which tensors differ, and which ranks
and nodes this job already replaced for corruption.

The fault model the rule is sound under (docs/failure-model.md): a copy goes wrong by a fault of one
rank (its device or memory: a copy no other rank holds) or of one node (the same wrong bytes in any
number of that node's replicas, all of them included); wrong copies of two faults never equal each
other or the right one. Under it, equal copies on two nodes are right, and nothing else is. The rule
(:func:`decide`):

1. every compared copy is equal: AGREE (ranks that abstained, ``ckptless.state.live_prefix``, are not
   compared and never named);
2. a copy is *proven* when strictly more than half of the compared copies equal it and those copies
   span more than one node (a majority on one node may be that node's fault repeated; so in a set
   whose replicas all run on one node no copy is ever proven: counting ranks cannot tell a bad device
   from a bad node writing the same bytes into all but one of them);
3. a proven copy: every rank holding another copy is corrupt. REPLACE them, unless one of them, or
   its node, was already replaced for corruption in this job (replacing it again would loop), or they
   are more than :data:`MAX_RANKS` (more than can be named exactly), or they include a rank together
   with every one of its mirror holders (its state that is not replicated, RNG streams and data
   position, would be left in no process: the caller passes the placement's ``holders``): then STOP;
4. no proven copy (a tie, more differing copies than equal ones, a majority on one node): STOP; but
   where ranks abstained and their copies could still prove one (enough of them to make a majority),
   DEFER once: nothing is committed, and the next round decides; a set that deferred the round before
   (``Evidence.deferred``, remembered by every member) stops instead, so at most one round in a row
   is undecided. A tie confined to one node is not taken as proof that the node is bad: the node's
   copies are as many as the others, so either side could be the faulty one.

The summary (:class:`Evidence`) is mergeable (:func:`merge`) and of a fixed size (:func:`encode`):
a reduction up the set's agreement tree and a pass down give every member the same one, at
O(log W) hops and ``8 * VECTOR_LEN`` bytes per message. It is exact while the set holds at most
:data:`MAX_COPIES` distinct copies; beyond that counts are lower bounds and the verdict stops.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

MAX_COPIES = 8  # distinct copies a summary keeps exactly
MAX_RANKS = 8  # ranks listed per copy; the most ranks one verdict replaces
MAX_TENSORS = 16  # differing tensors named
MAX_STRIKES = 8  # earlier replacements for corruption remembered (the newest)
NONE = -1


def key_of(data: bytes) -> int:
    """A 62-bit non-negative key (fits an int64 on the wire, never :data:`NONE`)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 2


def fingerprint(checksums: Sequence[int]) -> int:
    """One number for a copy: its prefix's chunk checksums, length included."""
    return key_of(np.asarray(list(checksums), dtype=np.int64).tobytes() + len(checksums).to_bytes(8, "little"))


def node_key(node: object) -> int:
    return key_of(str(node).encode())


@dataclass(frozen=True)
class Strike:
    """A rank replaced for corruption in this job: its rank, its node's key, the version it was found at."""

    rank: int
    node: int
    version: int


@dataclass(frozen=True)
class Copy:
    """The ranks holding one copy (equal prefixes): how many, their first two nodes, the lowest ranks."""

    fp: int
    count: int
    nodes: tuple[int, ...]  # the (at most 2) smallest node keys among its holders
    members: tuple[tuple[int, int], ...]  # (rank, node key) of its MAX_RANKS lowest ranks

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r for r, _ in self.members)


@dataclass(frozen=True)
class Evidence:
    """What a subtree of the replica set knows (mergeable; see the module doc)."""

    compared: int = 0  # ranks whose copy was compared
    abstained: int = 0
    dropped: int = 0  # ranks of copies beyond MAX_COPIES (then no longer exact)
    copies: tuple[Copy, ...] = ()  # sorted by fingerprint
    set_nodes: tuple[int, ...] = ()  # the (at most 2) smallest node keys of the set's members
    tensors: tuple[int, ...] = ()  # the lowest MAX_TENSORS indices of tensors found differing
    more_tensors: bool = False
    strikes: tuple[Strike, ...] = ()
    deferred: bool = False  # some member remembers that the set's previous round deferred its verdict


def _two(nodes: Iterable[int]) -> tuple[int, ...]:
    return tuple(sorted(set(nodes)))[:2]


def leaf(rank: int, node: int, fp: int | None, tensors: Iterable[int] = (), strikes: Iterable[Strike] = (),
         deferred: bool = False) -> Evidence:
    """One member's evidence: its copy's fingerprint (None: it abstained), the tensors it found differing
    from a neighbour's, the replacements for corruption it remembers, and whether it remembers that the
    previous round's verdict was deferred."""
    found = sorted(set(tensors))
    kept = _newest(strikes)
    if fp is None:
        return Evidence(abstained=1, set_nodes=(node,), tensors=tuple(found[:MAX_TENSORS]),
                        more_tensors=len(found) > MAX_TENSORS, strikes=kept, deferred=deferred)
    return Evidence(1, 0, 0, (Copy(fp, 1, (node,), ((rank, node),)),), (node,), tuple(found[:MAX_TENSORS]),
                    len(found) > MAX_TENSORS, kept, deferred)


def _newest(strikes: Iterable[Strike]) -> tuple[Strike, ...]:
    return tuple(sorted(set(strikes), key=lambda s: (-s.version, s.rank, s.node))[:MAX_STRIKES])


def merge(a: Evidence, b: Evidence) -> Evidence:
    """Two disjoint subtrees' evidence as one (commutative; associative while exact)."""
    by_fp: dict[int, Copy] = {c.fp: c for c in a.copies}
    for c in b.copies:
        o = by_fp.get(c.fp)
        by_fp[c.fp] = c if o is None else Copy(c.fp, o.count + c.count, _two(o.nodes + c.nodes),
                                               tuple(sorted(o.members + c.members))[:MAX_RANKS])
    copies = sorted(by_fp.values(), key=lambda c: (-c.count, c.fp))
    dropped = a.dropped + b.dropped + sum(c.count for c in copies[MAX_COPIES:])
    found = sorted(set(a.tensors + b.tensors))
    return Evidence(a.compared + b.compared, a.abstained + b.abstained, dropped,
                    tuple(sorted(copies[:MAX_COPIES], key=lambda c: c.fp)), _two(a.set_nodes + b.set_nodes),
                    tuple(found[:MAX_TENSORS]), a.more_tensors or b.more_tensors or len(found) > MAX_TENSORS,
                    _newest(a.strikes + b.strikes), a.deferred or b.deferred)


# --- the wire: a fixed-size int64 vector ------------------------------------------------------------------
_HEAD = 10
_COPY = 4 + 2 * MAX_RANKS
VECTOR_LEN = _HEAD + MAX_COPIES * _COPY + MAX_TENSORS + 3 * MAX_STRIKES


def _pad(xs: Sequence[int], n: int) -> list[int]:
    return list(xs) + [NONE] * (n - len(xs))


def encode(e: Evidence) -> list[int]:
    out = [e.compared, e.abstained, e.dropped, int(e.more_tensors), *_pad(e.set_nodes, 2),
           len(e.copies), len(e.tensors), len(e.strikes), int(e.deferred)]
    for i in range(MAX_COPIES):
        if i < len(e.copies):
            c = e.copies[i]
            flat = [x for m in c.members for x in m]
            out += [c.fp, c.count, *_pad(c.nodes, 2), *_pad(flat, 2 * MAX_RANKS)]
        else:
            out += [NONE] * _COPY
    out += _pad(e.tensors, MAX_TENSORS)
    for i in range(MAX_STRIKES):
        out += [e.strikes[i].rank, e.strikes[i].node, e.strikes[i].version] if i < len(e.strikes) else [NONE] * 3
    assert len(out) == VECTOR_LEN
    return out


def decode(v: Sequence[int]) -> Evidence:
    """The summary a peer sent (ValueError: malformed, never trusted)."""
    if len(v) != VECTOR_LEN:
        raise ValueError(f"replica evidence of {len(v)} numbers, expected {VECTOR_LEN}")
    compared, abstained, dropped, more, na, nb, n_copies, n_tensors, n_strikes, deferred = (int(x) for x in v[:_HEAD])
    if min(compared, abstained, dropped) < 0 or not (0 <= n_copies <= MAX_COPIES and 0 <= n_tensors <= MAX_TENSORS
                                                     and 0 <= n_strikes <= MAX_STRIKES):
        raise ValueError(f"malformed replica evidence header {list(v[:_HEAD])}")
    copies = []
    for i in range(n_copies):
        at = _HEAD + i * _COPY
        fp, count, ca, cb = (int(x) for x in v[at: at + 4])
        flat = [int(x) for x in v[at + 4: at + _COPY]]
        members = tuple((flat[j], flat[j + 1]) for j in range(0, len(flat), 2) if flat[j] != NONE)
        if count < 1 or len(members) != min(count, MAX_RANKS):
            raise ValueError(f"malformed copy in replica evidence: {count} ranks, {len(members)} listed")
        copies.append(Copy(fp, count, tuple(x for x in (ca, cb) if x != NONE), members))
    at = _HEAD + MAX_COPIES * _COPY
    tensors = tuple(int(x) for x in v[at: at + n_tensors])
    at += MAX_TENSORS
    strikes = tuple(Strike(int(v[at + 3 * i]), int(v[at + 3 * i + 1]), int(v[at + 3 * i + 2])) for i in range(n_strikes))
    if sum(c.count for c in copies) + dropped != compared:
        raise ValueError("replica evidence does not add up: copies and dropped ranks differ from those compared")
    return Evidence(compared, abstained, dropped, tuple(copies), tuple(x for x in (na, nb) if x != NONE), tensors,
                    bool(more), strikes, bool(deferred))


# --- the verdict ------------------------------------------------------------------------------------------
Kind = Literal["agree", "replace", "defer", "stop"]
Why = Literal["agree", "majority", "no_majority", "one_node", "single_node", "too_many", "again", "holders"]
Holders = Callable[[int], Sequence[int]]  # a rank's mirror holders (the placement's; mirror/placement.py)


@dataclass(frozen=True)
class Verdict:
    kind: Kind
    why: Why
    evidence: Evidence
    proven: Copy | None = None  # the copy proven right (a strict majority on more than one node); else None
    minority: tuple[tuple[int, int], ...] = ()  # (rank, node key) of every other copy's holder, when exact
    again: tuple[Strike, ...] = field(default=())  # earlier replacements the minority repeats
    orphans: tuple[tuple[int, tuple[int, ...]], ...] = ()  # (rank, its holders) the minority would take out whole

    def leaves(self, fp: int | None) -> bool:
        """Does the member holding ``fp`` leave to be rebuilt (REPLACE, and its copy is not the proven one)?"""
        return self.kind == "replace" and fp is not None and self.proven is not None and fp != self.proven.fp

    def proven_right(self, fp: int | None) -> bool:
        """Is ``fp`` the copy the evidence proves right (a restore source)?"""
        return fp is not None and self.proven is not None and fp == self.proven.fp


def decide(e: Evidence, holders: Holders) -> Verdict:
    """The rule of the module doc, from one set's whole evidence; ``holders``: each rank's mirror holders
    (every member passes the same placement, so every member decides alike)."""
    if e.dropped == 0 and len(e.copies) <= 1:
        return Verdict("agree", "agree", e)
    best = max(e.copies, key=lambda c: (c.count, -c.fp))
    majority = 2 * best.count > e.compared
    if len(e.set_nodes) < 2:  # every replica on one node: nothing can be proven, nor by waiting
        return Verdict("stop", "single_node", e)
    if not majority or len(best.nodes) < 2:
        why: Why = "no_majority" if not majority else "one_node"
        # The abstainers' copies could make a majority (on another node too): wait one round for them.
        could = e.abstained > 0 and 2 * (best.count + e.abstained) > e.compared + e.abstained
        return Verdict("defer" if could and not e.deferred else "stop", why, e)
    others = [c for c in e.copies if c.fp != best.fp]
    if e.dropped or sum(c.count for c in others) > MAX_RANKS:
        return Verdict("stop", "too_many", e, best)  # proven (counts are lower bounds), too many to name
    minority = tuple(sorted(m for c in others for m in c.members))
    ranks, nodes = {r for r, _ in minority}, {n for _, n in minority}
    again = tuple(s for s in e.strikes if s.rank in ranks or s.node in nodes)
    if again:
        return Verdict("stop", "again", e, best, minority, again)
    orphans = tuple((r, tuple(hs)) for r in sorted(ranks) if set(hs := holders(r)) <= ranks)
    if orphans:
        return Verdict("stop", "holders", e, best, minority, orphans=orphans)
    return Verdict("replace", "majority", e, best, minority)


# --- what a human reads ------------------------------------------------------------------------------------
def ranks_text(ranks: Sequence[int], count: int | None = None) -> str:
    """``rank 2`` / ``ranks 0, 1`` / ``ranks 0, 1, ... and 5 more``."""
    count = len(ranks) if count is None else count
    listed = ", ".join(str(r) for r in ranks)
    more = f" and {count - len(ranks)} more" if count > len(ranks) else ""
    return f"rank{'s' if count > 1 else ''} {listed}{more}"


def describe(v: Verdict, version: int, tensor_name: Callable[[int], str], node_name: Callable[[int], str]) -> str:
    """One line naming the ranks, their nodes where it matters, the tensors and the step."""
    e = v.evidence
    names = [tensor_name(i) for i in e.tensors]
    what = (", ".join(names) + (" and more" if e.more_tensors else "")) if names else "the padding between tensors"

    def on(c: Copy) -> str:
        if len(c.nodes) == 1:
            return f" (all on {node_name(c.nodes[0])})" if c.count > 1 else f" (on {node_name(c.nodes[0])})"
        return ""

    head = f"silent data corruption at step {version}: "
    if v.proven is not None and v.minority:
        p = v.proven
        odd = sorted({r for r, _ in v.minority})
        nodes = sorted({n for _, n in v.minority})
        who = ranks_text(odd) + (f" (on {node_name(nodes[0])})" if len(nodes) == 1 else "")
        verb = "is the odd one" if len(odd) == 1 else "are the odd ones"
        proof = (f"the copy that {ranks_text(p.ranks, p.count)} hold ({p.count} of {e.compared}"
                 f"{', on several nodes' if len(p.nodes) > 1 else ''})")
        if v.why == "again":
            earlier = "; ".join(f"rank {s.rank} on {node_name(s.node)} at step {s.version}" for s in v.again)
            return (f"{head}{who} {verb} again, in {what}: a rank or node already replaced for corruption in this job "
                    f"({earlier}); replacing it again would loop, so the job stops ({proof} agree)")
        if v.why == "holders":
            whole = "; ".join(f"rank {r} with {'its only holder' if len(hs) == 1 else 'all its holders'} "
                              f"{ranks_text(hs)}" if hs else f"rank {r} (it has no holder)" for r, hs in v.orphans)
            return (f"{head}{who} {verb}: {'its' if len(odd) == 1 else 'their'} replicated state differs from {proof} "
                    f"in {what}; but replacing them would take out {whole} at once, and the state of a rank that is "
                    "not replicated (its RNG streams, data position, private optimizer state) is kept in memory only "
                    "by the rank and its mirror holders, so nothing could rebuild it: the job stops instead")
        return f"{head}{who} {verb}: {'its' if len(odd) == 1 else 'their'} replicated state differs from {proof} in {what}"
    if v.why == "too_many":
        assert v.proven is not None
        p = v.proven
        return (f"{head}{e.compared - p.count} ranks hold copies that differ from the one {ranks_text(p.ranks, p.count)} "
                f"hold ({p.count} of {e.compared}), in {what}: more than {MAX_RANKS} at once are not replaced")
    groups = sorted(e.copies, key=lambda c: (-c.count, c.members[0][0]))
    parts = [f"{ranks_text(c.ranks, c.count)}{on(c)} hold {'one copy' if i == 0 else 'another'}"
             for i, c in enumerate(groups)]
    if e.dropped:
        parts.append(f"{e.dropped} more ranks hold yet other copies")
    if e.abstained:
        parts.append(f"{e.abstained} rank(s) could not be compared")
    after = ("; the previous round was deferred for ranks that could not be compared, and this one is undecided "
             "too" if e.deferred and v.kind == "stop" else "")
    if v.kind == "defer":
        return (f"replica mismatch at step {version}, undecided: {', '.join(parts)}; they differ in {what}. No copy "
                "is proven right yet, and the ranks that could not be compared could prove one: nothing is "
                "committed, and the next round decides (a second undecided round stops the job)")
    if v.why == "single_node":
        return (f"{head}{', '.join(parts)}; they differ in {what}. Every replica runs on "
                f"{node_name(e.set_nodes[0])}, where one faulty node can write the same wrong bytes into any number "
                "of them, so counting ranks proves no copy right: none is rebuilt from another and the job stops")
    if v.why == "one_node":
        return (f"{head}no majority on more than one node: {', '.join(parts)}; they differ in {what}. The larger "
                f"copy sits on one node, where one faulty node would put the same bytes, so no copy is proven right"
                f"{after}")
    per_node = ("; each copy sits on one node, and either node may be the faulty one" if all(
        len(c.nodes) == 1 for c in groups) and len(e.set_nodes) > 1 and not e.dropped else "")
    return (f"{head}no majority: {', '.join(parts)}; they differ in {what}. No copy is proven right (a tie, or more "
            f"differing copies than equal ones), so none is rebuilt from another and the job stops{per_node}{after}")


__all__ = ["MAX_COPIES", "MAX_RANKS", "MAX_STRIKES", "MAX_TENSORS", "VECTOR_LEN", "Copy", "Evidence", "Holders",
           "Strike", "Verdict", "decide", "decode", "describe", "encode", "fingerprint", "leaf", "merge", "node_key",
           "ranks_text"]
