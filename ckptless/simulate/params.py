"""The simulated job's parameters, validated once (pure).

Why one frozen record: every policy, the failure process and the placement analysis read
the same numbers, and a sweep (:mod:`ckptless.simulate.recommend`) varies a few of them with
:func:`dataclasses.replace`; validation in ``__post_init__`` means a bad value fails the same
way from the command line, a preset or a sweep: one :class:`~ckptless.errors.ConfigError`
naming the field and its value.

Units: seconds, MiB of state per rank, GB/s (1e9 bytes) of bandwidth. Where a default
comes from is said beside it; the presets (:mod:`ckptless.simulate.presets`) override
them with the published figures of a large job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from ckptless.errors import ConfigError

MIB = float(1 << 20)
GB = 1e9
PLACEMENTS = ("ring", "group")
LOST_NODE = ("wait", "shrink")
#: The failure classes: ``software`` a process that dies on a healthy node (respawnable there:
#: what ``ckptless-chaos`` injects), ``accelerator`` one rank's device gone (needs another device),
#: ``node`` every rank of one node gone at once (correlated: a host, its NIC, a switch port).
KINDS = ("software", "accelerator", "node")


@dataclass(frozen=True)
class Params:
    """One job and its platform. Defaults: this 2-core machine, as ``bench/goodput_check.py`` runs.

    The recovery costs here come from docs/benchmarks.md (bench/scale.py, 2026-11-28: kill ->
    resumed 0.98 s median at W = 4, 1.61 s at W = 32; bench/recovery.py, 2026-11-23: transfer,
    respawn ready 0.28 s, setup 0.9 s at 256 MiB; DESIGN.md's measured facts: torchrun + DCP
    restart 6.2-6.4 s to every rank through init_process_group, copy 3.5-4.0 GB/s, Gloo p2p
    1.2-2.4 GB/s); ``recovery_fixed_s`` and ``mirror_fixed_s`` are the median fit over the five
    round-1 runs of docs/benchmarks.md ("Simulator: calibration and validation", bench/goodput_calibrate.py).
    """

    # the job
    world: int = 4                       # W ranks (accelerators) that train
    nproc_per_node: int = 2              # P ranks per node
    state_mib: float = 16.0              # S: protected bytes per rank, MiB
    step_s: float = 0.22                 # one training step at full width, bare (without ckptless; the bench's 0.2 s
    #                                      sleep + AdamW of 16 MiB: 0.218-0.235 s measured)
    duration_s: float = 300.0            # simulated wall time
    # failures
    mtbf_s: float = 30.0                 # the JOB's mean time between failures (every rank and node together)
    mix_software: float = 1.0            # fraction of failures of each class (normalised)
    mix_accelerator: float = 0.0
    mix_node: float = 0.0
    # ckptless
    replicas: int = 1                    # K
    placement: str = "ring"              # ring: a node's holders are the next K nodes; group: groups of K + 1 nodes
    mirror_every: int = 1                # mirror every N steps
    spares: int = 0                      # warm spare ranks (on spare nodes), refilled by the scheduler
    snapshot_every_s: float = 0.0        # ckptless's disk snapshot interval (0: none; the last resort)
    lost_node: str = "wait"              # no spare for a lost device: wait for the scheduler, or train on with fewer
    node_local: bool = False             # own images in /dev/shm (ckptless-run's default; bench/goodput_check.py runs
    #                                      --no-shm-dir): a process that dies on a healthy node leaves its image there
    detect_s: float = 0.12               # kill -> first survivor knows (bench/recovery.py 2026-11-23: 0.11-0.14 s)
    detect_node_s: float = 2.0           # a node lost whole: its agent's lease must expire (ckptless-run --lease-ttl)
    recovery_fixed_s: float = 0.82       # report, plan, publish, form the new generation (calibrated here, 2026-11-28)
    plan_s_per_rank: float = 8.6e-5      # leader's O(W) planning (bench/control_plane.py --plan-only: 0.86 s at 10k)
    contention_s_per_rank: float = 0.022  # CPU of W processes on 2 cores (bench/scale.py: 0.98 -> 1.61 s, W 4 -> 32)
    respawn_s: float = 0.28              # a warm respawn is ready (bench/recovery.py 2026-11-23)
    setup_s_per_gib: float = 3.5         # the script builds its state again (0.9 s at 256 MiB, same run)
    mirror_fixed_s: float = 0.001        # per mirrored step beyond the copy: commit, CRC, the round's CPU (calibrated)
    capture_blocking: float = 1.0        # share of the capture copy on the training thread (CPU: 1; GPU async: ~0.05)
    reprotect_s: float = 0.0             # extra re-protection time after resume (0: the round's S K / nic)
    # platform
    nic_gbps: float = 1.5                # per-rank point-to-point bandwidth (Gloo p2p here: 1.2-2.4 GB/s)
    host_gbps: float = 3.5               # copy into preallocated host memory (3.5-4.0 GB/s here)
    disk_gbps: float = 0.7               # the job's aggregate checkpoint bandwidth (DCP here: 4 x 256 MiB saved in 1.5 s)
    replace_s: float = 15.0              # the scheduler brings a replacement node (bench/node_loss.py: 15 s)
    comm_base_s: float = 0.05            # forming the world's communicators: fixed part (Gloo here: 2-90 ms)
    comm_per_rank_s: float = 0.0         # ... and per rank (stock NCCL init: ~265 s at 96k GPUs = 2.7 ms/rank)
    # restart-from-disk (torchrun + DCP)
    restart_s: float = 6.3               # kill -> every rank through init_process_group (DESIGN.md: 6.2-6.4 s)
    requeue_s: float = 0.0               # the scheduler stops and requeues the whole job (0: torchrun restarts in place)
    ckpt_every_s: float = 0.0            # checkpoint interval (0: the Young/Daly optimum)
    save_block_s: float = 0.0            # blocking part of a save (0: W S / disk_gbps, a synchronous DCP save)
    # TorchFT-style: drop a data-parallel replica group
    ft_group_ranks: int = 0              # ranks per replica group (0: one node); W / this = R groups
    ft_quorum_s: float = 1.0             # survivors' quorum + reconfiguring the cross-group communicator
    ft_overhead: float = 0.0             # per-step cost of its per-step quorum (not measured here: assumed 0)
    # the failure process of a chaos run: an arrival during a recovery lands once the job trains again
    # (bench/goodput_check.py's kills); False: it lands when it comes, as a real failure does
    defer_in_recovery: bool = False
    # the job's own start (launch -> first step: processes, imports, rendezvous), badput "startup"; failures
    # due before it land at its end (ckptless-chaos goodput: "failures during start-up are not in the mix")
    startup_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(f.default, bool):
                if not isinstance(v, bool):
                    raise ConfigError(f.name, v, "must be true or false")
            elif isinstance(v, bool) or not isinstance(v, (int, float, str)) or (
                    isinstance(v, float) and not math.isfinite(v)):
                raise ConfigError(f.name, v, "must be a finite number" if not isinstance(f.default, str) else "must be a name")
        _at_least(self, "world", 1)
        _at_least(self, "nproc_per_node", 1)
        _at_least(self, "replicas", 0)
        _at_least(self, "mirror_every", 1)
        _at_least(self, "spares", 0)
        _at_least(self, "ft_group_ranks", 0)
        for name in ("state_mib", "step_s", "duration_s", "mtbf_s", "nic_gbps", "host_gbps", "disk_gbps"):
            if not getattr(self, name) > 0:
                raise ConfigError(name, getattr(self, name), "must be > 0")
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0:
                raise ConfigError(f.name, v, "must be >= 0")
        if self.world % self.nproc_per_node:
            raise ConfigError("world", self.world, f"must be a multiple of nproc_per_node={self.nproc_per_node}")
        if self.mix_software + self.mix_accelerator + self.mix_node <= 0:
            raise ConfigError("mix_software", self.mix_software, "the failure mix must not be all zero")
        if self.placement not in PLACEMENTS:
            raise ConfigError("placement", self.placement, f"must be one of {', '.join(PLACEMENTS)}")
        if self.lost_node not in LOST_NODE:
            raise ConfigError("lost_node", self.lost_node, f"must be one of {', '.join(LOST_NODE)}")
        if self.replicas >= self.nodes and self.replicas > 0:
            raise ConfigError("replicas", self.replicas, f"node-aware placement needs K < nodes ({self.nodes})")
        if self.ft_group_ranks and (self.world % self.ft_group_ranks or self.ft_group_ranks % self.nproc_per_node):
            raise ConfigError("ft_group_ranks", self.ft_group_ranks,
                              f"must divide world={self.world} and be whole nodes of {self.nproc_per_node}")
        if self.capture_blocking > 1:
            raise ConfigError("capture_blocking", self.capture_blocking, "is a share: at most 1")

    # -- derived ---------------------------------------------------------------------------
    @property
    def nodes(self) -> int:
        return self.world // self.nproc_per_node

    @property
    def state_bytes(self) -> float:
        return self.state_mib * MIB

    @property
    def mix(self) -> dict[str, float]:
        total = self.mix_software + self.mix_accelerator + self.mix_node
        return {"software": self.mix_software / total, "accelerator": self.mix_accelerator / total,
                "node": self.mix_node / total}

    @property
    def group_ranks(self) -> int:
        return self.ft_group_ranks or self.nproc_per_node

    @property
    def ft_groups(self) -> int:
        return self.world // self.group_ranks

    @property
    def round_s(self) -> float:
        """One mirror round (background): K copies of S over the rank's link."""
        return self.replicas * self.state_bytes / (self.nic_gbps * GB)

    @property
    def mirror_block_s(self) -> float:
        """What a mirrored step adds to the training thread: the capture's blocking share + the rest."""
        if self.replicas == 0:
            return 0.0
        return self.capture_blocking * self.state_bytes / (self.host_gbps * GB) + self.mirror_fixed_s

    @property
    def mirror_overhead(self) -> float:
        """Fraction of wall time mirroring takes from a failure-free run: block / (N step + block)."""
        b = self.mirror_block_s
        return b / (self.mirror_every * self.step_s + b)

    @property
    def save_s(self) -> float:
        """A disk checkpoint's blocking part: given, else a synchronous DCP save (every rank writes S at
        the job's aggregate bandwidth; measured here: 1.5 s for 4 x 256 MiB, DESIGN.md)."""
        return self.save_block_s or self.write_s

    @property
    def load_s(self) -> float:
        """Every rank reads its S from the checkpoint store at the job's aggregate bandwidth."""
        return self.world * self.state_bytes / (self.disk_gbps * GB)

    @property
    def write_s(self) -> float:
        """Writing one checkpoint of the whole job to storage (W S at the aggregate bandwidth)."""
        return self.world * self.state_bytes / (self.disk_gbps * GB)

    @property
    def snapshot_block_s(self) -> float:
        """What one of ckptless's own disk snapshots holds the loop: its copy out of the live state (the
        write is the background's; docs/snapshots.md: 0.044-0.049 s for 256 MiB here)."""
        return self.capture_blocking * self.state_bytes / (self.host_gbps * GB)

    @property
    def restart_interval_s(self) -> float:
        """Restart-from-disk's checkpoint interval: given, else Young/Daly sqrt(2 save MTBF), never
        shorter than one checkpoint's write (an asynchronous save must finish before the next)."""
        return self.ckpt_every_s or max(young_daly(self.save_s, self.mtbf_s), self.write_s)


def young_daly(save_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum checkpoint interval, sqrt(2 C M) (Young 1974; Daly 2006)."""
    return math.sqrt(2.0 * max(save_s, 1e-9) * mtbf_s)


def _at_least(p: Params, name: str, low: int) -> None:
    v = getattr(p, name)
    if not isinstance(v, int) or v < low:
        raise ConfigError(name, v, f"must be a whole number >= {low}")
