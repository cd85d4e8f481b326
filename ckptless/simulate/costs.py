"""What one recovery costs, phase by phase, as a function of W and S (pure).

Why separate from the policies: these are the numbers one argues about. Each phase says
where its figure comes from; the policies (:mod:`ckptless.simulate.policies`) only decide
*which* phases an incident pays (a spare or a respawn, a wait for the scheduler, a disk
fallback).

Sources (file and date):

* ckptless's own phases at small W: docs/benchmarks.md, ``bench/recovery.py`` 2026-11-23
  ("Recovery with only the missing bytes on the path": detect 0.11-0.14 s, respawn ready
  0.28 s, setup 0.90 s at 256 MiB, transfer stripes at Gloo p2p speed) and ``bench/scale.py``
  2026-11-28 (kill -> resumed 0.98 s median at W = 4, 1.61 s at W = 32, 10 runs each).
* Growth in W: the leader's O(W) planning, ``bench/control_plane.py --plan-only`` 2026-11-27
  (0.32 + 0.54 s at W = 10,000: ~86 us per rank); the CPU contention of W processes on this
  machine's 2 cores, fitted to bench/scale.py's 0.98 -> 1.61 s (22 ms per rank; 0 on a
  cluster, where each rank has its own cores: docs/scale.md, "window_cpu_s"); the commit
  agreement's O(log W) hops (docs/scale.md: 2 depth(W), depth = ceil(log4(3W + 1)) - 1).
* Communicator formation at scale, from published figures (nothing here ran NCCL on more than
  one GPU): stock NCCL initialisation ~265 s at ~96k GPUs (2.7 ms per rank, linear), and
  MegaScale (ByteDance, NSDI'24) under 30 s at 10k+ GPUs (~3 ms per rank: the same slope),
  so the presets take 2.7 ms per rank; a job with a faster init changes the answer
  (docs/goodput.md, "What would change the answer").
"""

from __future__ import annotations

import math

from ckptless.simulate.params import GB, Params

HOP_S = 0.001  # one agreement hop (a 24-byte message between hosts)


def comm_init_s(p: Params, ranks: int) -> float:
    """Forming communicators over ``ranks`` ranks: fixed + linear (see the module doc)."""
    return p.comm_base_s + p.comm_per_rank_s * ranks


def agreement_s(world: int) -> float:
    depth = max(0, math.ceil(math.log(3 * world + 1, 4)) - 1)
    return 2 * depth * HOP_S


def ckptless_reform_s(p: Params) -> float:
    """Report, plan, publish and form the new generation (ckptless re-forms every communicator)."""
    w = p.world
    return (p.recovery_fixed_s + p.plan_s_per_rank * w + p.contention_s_per_rank * w + agreement_s(w)
            + comm_init_s(p, w))


def transfer_s(p: Params, ranks_lost: int) -> float:
    """The lost ranks' images, striped from their K holders: S over one link per lost rank (all in parallel)."""
    if ranks_lost == 0:
        return 0.0
    return p.state_bytes / (p.nic_gbps * GB)


def restore_s(p: Params) -> float:
    """Copy the image into the live state (in place: host copy speed)."""
    return p.state_bytes / (p.host_gbps * GB)


def setup_s(p: Params) -> float:
    """A respawned rank runs the script's setup (builds model and optimizer) before it joins."""
    return p.setup_s_per_gib * p.state_mib / 1024.0


def first_step_extra_s(p: Params) -> float:
    """The first step after a recovery captures the resume version again (blocking share)."""
    return p.mirror_block_s


def ckptless_phases(p: Params, *, kind: str, spare: bool, disk: bool, ranks_lost: int) -> list[tuple[str, float]]:
    """One ckptless incident's downtime as (badput category, seconds), in order.

    ``spare``: a pre-built spare takes the lost ranks (no setup); else a warm respawn on the
    node (``software``) or on the scheduler's replacement (the wait is the policy's, not here).
    ``disk``: the failure set defeated the placement: every rank loads the last snapshot.
    """
    detect = p.detect_node_s if kind == "node" else p.detect_s
    ready = 0.0 if spare else p.respawn_s + setup_s(p)
    reform = ckptless_reform_s(p)
    out = [("detection", detect), ("reformation", max(reform, ready))]
    if disk:
        out.append(("disk_restore", p.load_s))
    else:
        out.append(("transfer", transfer_s(p, ranks_lost)))
        out.append(("rollback", restore_s(p)))
    out.append(("reprotection", first_step_extra_s(p)))
    return out


def restart_phases(p: Params, *, kind: str) -> list[tuple[str, float]]:
    """Restart-from-disk: every process stops, the job is restarted (requeued on a cluster),
    every rank starts, forms the world's communicators and loads the last checkpoint."""
    detect = p.detect_node_s if kind == "node" else p.detect_s
    return [("detection", detect), ("restart", p.requeue_s + p.restart_s),
            ("reformation", comm_init_s(p, p.world)), ("disk_restore", p.load_s)]


def torchft_stall(p: Params, kind: str) -> list[tuple[str, float]]:
    """What the surviving replica groups lose when one group drops: detection, then a quorum
    that reconfigures the cross-group communicator (R members)."""
    detect = p.detect_node_s if kind == "node" else p.detect_s
    return [("detection", detect), ("reformation", p.ft_quorum_s + comm_init_s(p, p.ft_groups))]


def torchft_rejoin_s(p: Params) -> float:
    """The dropped group comes back: its processes restart, form the group's communicators, heal its
    state from a live replica (S per rank over the link), then join the next quorum."""
    return p.restart_s + comm_init_s(p, p.group_ranks) + p.state_bytes / (p.nic_gbps * GB) + p.ft_quorum_s


def reprotect_window_s(p: Params) -> float:
    """After a resume, how long the replaced ranks' images are held by fewer than K peers."""
    return p.reprotect_s or p.round_s
