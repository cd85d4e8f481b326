"""When a failure set defeats the mirrors' placement, exactly and in closed form (pure).

A rank's image is held by K peers on K other nodes (node-aware placement,
``ckptless/mirror/placement.py``): ``ring``, a node's ranks mirror onto the next K nodes
(same local index); ``group``, nodes form groups of K + 1 that mirror each other. Memory
cannot cover a recovery when a rank *and* all its K holders are lost before the first
loss is re-protected: then ckptless falls back to the last disk snapshot.

Three views, which the tests hold against each other:

* :func:`defeats`: the simulator's check of one failure against what is still down;
* :func:`p_defeat_given_f`: Gemini's static question (SOSP'23, section 5: the probability
  that f simultaneously failed machines include a whole replica group), counted exactly:
  for ``group`` the f-subsets hitting no whole group are the x^f coefficient of
  ((1 + x)^m - x^m)^g (m = K + 1, g = N / m groups); for ``ring`` the f-subsets of the
  N-cycle with no K + 1 consecutive nodes, a transfer-matrix trace;
* :func:`p_defeat_per_failure`: the dynamic one, correlated node failures included: each
  unit (a rank, or a whole node) stays unprotected for a window w after it fails; with
  Poisson failures, a rank is found lost w.p. a = (q_rank + q_node), q = rate x w, and a
  new failure defeats when, in one of the placement windows that contain it, the other K
  positions are lost: per window a^K for a rank; P a^K - (P - 1) q_node^K for a whole node
  (its P ranks share the other nodes' whole-node losses: inclusion-exclusion to first
  order); ring has K + 1 windows per position, group one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from ckptless.simulate.failures import rates
from ckptless.simulate.params import Params

Unit = tuple[int, int | None]  # (node, local) ; local None: the whole node


def holder_nodes(n: int, nodes: int, k: int, placement: str) -> list[int]:
    """The nodes that hold node ``n``'s ranks' images (same local index)."""
    if k == 0:
        return []
    if placement == "ring":
        return [(n + j) % nodes for j in range(1, k + 1)]
    m = k + 1
    start = min((n // m) * m, nodes - m)  # a short last group borrows the nodes before it
    return [x for x in range(start, start + m) if x != n][:k]


def _lost(unit_node: int, local: int, down: set[Unit]) -> bool:
    return (unit_node, None) in down or (unit_node, local) in down


def defeats(new: Unit, down: Iterable[Unit], p: Params) -> bool:
    """Does losing ``new`` while ``down`` are still unprotected leave some rank with no live copy?"""
    k = p.replicas
    if k == 0:
        return True
    lost = set(down) | {new}
    n, local = new
    locals_ = range(p.nproc_per_node) if local is None else [local]
    # the ranks whose own copy or one of whose holders' copies the new loss touched
    owners = {n} | {m for m in _owners_of(n, p)}
    for o in owners:
        hs = holder_nodes(o, p.nodes, k, p.placement)
        for lo in locals_:
            if _lost(o, lo, lost) and all(_lost(h, lo, lost) for h in hs):
                return True
    return False


def _owners_of(n: int, p: Params) -> list[int]:
    """Nodes whose holders include ``n``."""
    k, nodes = p.replicas, p.nodes
    if p.placement == "ring":
        return [(n - j) % nodes for j in range(1, k + 1)]
    m = k + 1
    start = min((n // m) * m, nodes - m)
    return [x for x in range(start, start + m) if x != n and n in holder_nodes(x, nodes, k, p.placement)]


def _poly_mul(a: list[int], b: list[int], cap: int) -> list[int]:
    out = [0] * (cap + 1)
    for i, x in enumerate(a):
        if x and i <= cap:
            for j, y in enumerate(b[: cap + 1 - i]):
                out[i + j] += x * y
    return out


def _poly_pow(a: list[int], e: int, cap: int) -> list[int]:
    result = [1] + [0] * cap
    while e:
        if e & 1:
            result = _poly_mul(result, a, cap)
        a = _poly_mul(a, a, cap)
        e >>= 1
    return result


def surviving_subsets(nodes: int, k: int, f: int, placement: str) -> int:
    """How many f-subsets of the nodes include no whole placement window (exact integer)."""
    m = k + 1
    if placement == "group" and nodes % m == 0:
        base = [math.comb(m, i) for i in range(m + 1)]
        base[m] -= 1  # ((1 + x)^m - x^m)
        return _poly_pow(base, nodes // m, f)[f]
    # ring (and a group layout whose last group is short: counted as a ring, a bound):
    # trace of T^N, T over states "run of failed nodes ending here" 0..k, entries polynomials in x
    size = k + 1
    zero = [0] * (f + 1)

    def mat_mul(x: list[list[list[int]]], y: list[list[list[int]]]) -> list[list[list[int]]]:
        out = [[list(zero) for _ in range(size)] for _ in range(size)]
        for i in range(size):
            for j in range(size):
                acc = list(zero)
                for t in range(size):
                    if any(x[i][t]) and any(y[t][j]):
                        prod = _poly_mul(x[i][t], y[t][j], f)
                        acc = [u + v for u, v in zip(acc, prod)]
                out[i][j] = acc
        return out

    t_m = [[list(zero) for _ in range(size)] for _ in range(size)]
    for r in range(size):
        t_m[r][0] = [1] + [0] * f                 # this node up: the run resets
        if r + 1 < size and f >= 1:
            t_m[r][r + 1] = [0, 1] + [0] * (f - 1)  # this node failed: the run grows (at most k)
    result = [[([1] + [0] * f) if i == j else list(zero) for j in range(size)] for i in range(size)]
    e = nodes
    while e:
        if e & 1:
            result = mat_mul(result, t_m)
        t_m = mat_mul(t_m, t_m)
        e >>= 1
    return sum(result[i][i][f] for i in range(size))


def p_defeat_given_f(nodes: int, k: int, f: int, placement: str) -> float:
    """Gemini's question: f whole nodes fail at once, uniformly; the chance some rank has no copy left."""
    if f <= k:
        return 0.0
    if f >= nodes:
        return 1.0
    return 1.0 - surviving_subsets(nodes, k, f, placement) / math.comb(nodes, f)


def p_defeat_per_failure(p: Params, window_s: float) -> float:
    """The chance one failure defeats the placement, with losses unprotected for ``window_s``
    (first order in q = rate x window; see the module doc). Mixed over the failure classes."""
    k = p.replicas
    if k == 0:
        return 1.0
    r = rates(p)
    q_rank, q_node = r["rank"] * window_s, r["node"] * window_s
    a = min(1.0, q_rank + q_node)
    # distinct placement windows holding one position: ring K + 1 (one, when the ring is a single window)
    windows = k + 1 if p.placement == "ring" and p.nodes > k + 1 else 1
    big_p = p.nproc_per_node
    per_rank = 1.0 - (1.0 - min(1.0, a ** k)) ** windows
    node_w = max(0.0, min(1.0, big_p * a ** k - (big_p - 1) * q_node ** k))
    per_node = 1.0 - (1.0 - node_w) ** windows
    mix = p.mix
    return (mix["software"] + mix["accelerator"]) * per_rank + mix["node"] * per_node
