"""Named jobs: the failure rates and sizes of published large runs, and where each number comes from.

Why presets: the answer users want is "what would ckptless give on *my* kind of job", and
the inputs that decide it (how often something fails, what fails, how long a scheduler takes)
are published for a few jobs. Everything marked *assumed* is not in a source; docs/goodput.md
lists them under "What would change the answer".

Sources:

* Llama 3: "The Llama 3 Herd of Models", Meta 2024, section 3.3.4 ("Reliability and
  operational challenges", Table 5): 419 unexpected interruptions in a 54-day snapshot of
  pre-training on 16,384 H100 GPUs; 58.7 % GPU-caused, 12.9 % software bugs, 8.4 % network
  switch/cable; storage (Tectonic) 2 TB/s sustained. Model 405B parameters, 16M-token batches.
* Meta's reliability study: Kokolis et al., "Revisiting Reliability in Large-Scale Machine
  Learning Research Clusters" (Meta, arXiv:2410.21680, HPCA 2025): job mean time to failure
  7.9 h at 1,024 GPUs, 1.8 h at 16,384, projected ~14 min at 131,072 GPUs.
* Communicator initialisation: stock NCCL ~265 s at ~96k GPUs (the issue's figure, as cited
  in issue 39) and MegaScale (Jiang et al., NSDI 2024) under 30 s at 10k+ GPUs: ~2.7-3 ms
  per rank, linear (:mod:`ckptless.simulate.costs`).
* This project's GPU runs (docs/benchmarks.md, "GPU (issue 19)" 2026-11-27 and "GPU (issue 36)"
  2026-11-28): capture into page-locked memory 45.5-50 GB/s on H100/H200; the asynchronous
  capture costs 0.0-0.5 % of a step 8-9x its copy (``capture_blocking`` 0.05).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ckptless.errors import ConfigError
from ckptless.simulate.params import Params

DAY = 86400.0

#: Platform and recovery figures shared by the GPU presets (H100-class nodes of 8 GPUs).
_GPU_CLUSTER: dict[str, Any] = dict(
    nproc_per_node=8,
    step_s=5.9,                  # 6 x 405e9 x 16M tokens / (16,384 x 400 TFLOP/s): Llama 3's 405B at ~40 % MFU
    state_mib=400.0,             # 405e9 params x 16 B (bf16 weights, fp32 master + 2 moments) / 16,384, sharded
    mix_software=0.129, mix_accelerator=0.587, mix_node=0.284,  # Llama 3 Table 5; the rest (host, network, ...) as node
    detect_s=5.0,                # assumed: a device error or crash reaches the coordinator (abort, agent reap)
    detect_node_s=10.0,          # assumed: a lost node's agent lease expires
    recovery_fixed_s=0.55,       # as here (bench/scale.py, 2026-11-28), minus what grows with W (below)
    contention_s_per_rank=0.0,   # a core per rank on a cluster (docs/scale.md: the growth here is CPU)
    respawn_s=30.0,              # assumed: a new process's CUDA context and imports on a GPU node
    setup_s_per_gib=3.5,         # as here (bench/recovery.py, 2026-11-23): the script builds its state again
    mirror_fixed_s=0.005,        # assumed: the round's commit and checksum, off a busy host
    capture_blocking=0.05,       # GPU async capture (docs/benchmarks.md, 2026-11-27)
    nic_gbps=25.0,               # assumed: half of a 400 Gb/s NIC per GPU (the other half is training's)
    host_gbps=45.5,              # pinned capture on an H200 (docs/benchmarks.md, 2026-11-28)
    disk_gbps=2000.0,            # Llama 3's Tectonic: 2 TB/s sustained, job-wide
    replace_s=600.0,             # assumed: the scheduler gives a replacement node in 10 minutes
    comm_base_s=0.05,
    comm_per_rank_s=2.7e-3,      # stock NCCL ~265 s at ~96k GPUs; MegaScale < 30 s at 10k+ (same slope)
    restart_s=120.0,             # assumed: every process starts, CUDA, imports, model build
    save_block_s=400 * 2**20 / 45.5e9,  # async DCP (torchtitan, Llama 3): the loop waits for the staging copy only
    requeue_s=600.0,             # assumed: the scheduler stops and requeues the whole job (DESIGN.md: 15-30 min a failure in all)
    ft_group_ranks=128,          # one model replica = TP 8 x PP 16 (Llama 3 405B's layout): R = W / 128 groups
    ft_quorum_s=1.0,             # assumed: TorchFT's lighthouse quorum
    snapshot_every_s=3600.0,     # ckptless's last-resort disk snapshot, hourly
    node_local=True,             # ckptless-run's default: own images in /dev/shm outlive a crashed process
)

PRESETS: dict[str, dict[str, Any]] = {
    # this machine, as bench/goodput_check.py runs (the defaults of Params)
    "local": {},
    "llama3-16k": dict(_GPU_CLUSTER, world=16384, duration_s=54 * DAY, mtbf_s=54 * DAY / 419),
    "meta-rsc": dict(_GPU_CLUSTER, world=16384, duration_s=54 * DAY, mtbf_s=1.8 * 3600),
    # ~100k GPUs (12,288 nodes of 8): Meta's per-GPU rate at 16k-131k (1.8 h x 16,384 ~ 14 min x 131,072
    # ~ 30,000 GPU-hours) gives a job MTBF of 30,000 / 98,304 h ~ 18 min; state 1 GiB per GPU (assumed: a
    # larger model than Llama 3's)
    "100k": dict(_GPU_CLUSTER, world=98304, duration_s=30 * DAY, mtbf_s=30000 * 3600 / 98304, state_mib=1024.0,
                 save_block_s=2**30 / 45.5e9),
}

SOURCES = {
    "local": "this machine: docs/benchmarks.md (bench/scale.py 2026-11-28, bench/recovery.py 2026-11-23) and the "
             "calibration in docs/benchmarks.md, 'Simulator: calibration and validation'",
    "llama3-16k": "Llama 3 Herd of Models (Meta 2024), sec. 3.3.4: 419 interruptions / 54 days / 16,384 H100; "
                  "58.7 % GPU, 12.9 % software, 8.4 % network",
    "meta-rsc": "Kokolis et al., Revisiting Reliability in Large-Scale ML Research Clusters (Meta, 2024): "
                "job MTTF 1.8 h at 16,384 GPUs (7.9 h at 1,024, ~14 min at 131,072)",
    "100k": "98,304 GPUs at Meta's ~30,000 GPU-hours per failure (1.8 h at 16k, ~14 min at 131k): job MTBF ~18 min",
}


def preset(name: str, **overrides: Any) -> Params:
    """The named preset with ``overrides`` (e.g. the command line's flags) applied on top."""
    if name not in PRESETS:
        raise ConfigError("preset", name, f"must be one of {', '.join(PRESETS)}")
    return replace(Params(**PRESETS[name]), **overrides)
