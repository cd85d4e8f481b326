"""Which GPU each worker of this node uses: members, spares, respawns, refills (pure, plus one count).

Why: a worker picks its GPU from ``LOCAL_RANK`` (``torch.cuda.set_device``),
and torchrun's convention, GPU = local rank, has no room for spares: a spare
used to get ``LOCAL_RANK = nproc_per_node + i``, which on a full node is an
invalid ordinal, with ``LOCAL_RANK % device_count`` a GPU a live rank already
uses (NCCL refuses a communicator with the same GPU twice), and with
``--virtual-local-rank`` ``CUDA_VISIBLE_DEVICES=8``, i.e. no GPU at all (it
trained on the CPU without a word). And a respawn after the GPU itself failed
(ECC, a GPU off the bus) started again on the same GPU, and failed again.

The rules (the agent's slot table applies them under its lock,
``launcher/slots.py``):

* How many GPUs the node offers: ``CKPTLESS_NODE_GPUS`` if set, else the
  entries of the agent's ``CUDA_VISIBLE_DEVICES``, else the driver's count
  (:func:`node_gpus`). 0 means a CPU job: nothing below applies and every
  worker's environment is what it always was.
* A member uses GPU = its local rank, as with torchrun (a script's
  ``set_device(LOCAL_RANK)`` must keep working); a local rank past the GPU
  count (an oversubscribed node) has no GPU of ours (``None``).
* A spare takes the lowest GPU that no live worker uses and that is not
  marked bad; it keeps it when it takes a rank (its objects are built there).
* A start with more members + spares than GPUs is refused with one line
  (:func:`check_spares`): the way out is a node of spares
  (``--nproc-per-node 0 --spares N``), not two processes on one GPU.
* A respawn keeps its slot's GPU unless that GPU was marked bad (its worker
  exited with a GPU-class error) or a live worker now uses it; then it takes
  the lowest free good GPU, and with none it is not started on this node
  (the exit record says so: the planner then gives the rank a spare or
  waits, see ``ckptless/recovery/plan.py`` R2).
* A ``--spare-refill`` spare takes the lowest free good GPU (e.g. the one a
  dead worker freed); with none, no refill starts.

Why "lowest free": deterministic (a test and a human can predict it) and it
packs spares next to the members, which is what NVLink topologies favour as
often as not; there is no better rule without the node's topology.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING

from ckptless.errors import ConfigError

if TYPE_CHECKING:  # a type only: the rules here read no environment (the node machine imports them)
    from ckptless.environment import ProcessEnv

NODE_GPUS_VAR = "CKPTLESS_NODE_GPUS"


def visible_entries(visible: str) -> list[str]:
    """The devices a ``CUDA_VISIBLE_DEVICES`` value names, in order (indices, UUIDs or MIG ids).

    As CUDA reads it: entries are comma separated, blanks ignored, and a negative index hides itself
    and every entry after it (``-1`` is the usual way to hide all GPUs)."""
    out: list[str] = []
    for raw in visible.split(","):
        entry = raw.strip()
        if not entry:
            continue
        if entry.lstrip("-").isdigit() and int(entry) < 0:
            break
        out.append(entry)
    return out


def node_gpus(env: ProcessEnv, environ: Mapping[str, str],
              device_count: Callable[[], int] | None = None) -> tuple[int, str]:
    """How many GPUs this node offers its workers, and where that number came from.

    ``CKPTLESS_NODE_GPUS`` wins (an operator who knows better, or 0 for a CPU job on a GPU host);
    then the agent's ``CUDA_VISIBLE_DEVICES`` (what the workers can see, counted without touching
    the driver); then ``torch.cuda.device_count()``, which asks NVML and does not initialise CUDA in
    the agent (it later forks its fork server). A CPU build of torch counts 0 at once.
    """
    if env.node_gpus is not None:
        return env.node_gpus, NODE_GPUS_VAR
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len(visible_entries(visible)), "CUDA_VISIBLE_DEVICES"
    if device_count is None:
        import torch  # deferred: only a node without either variable needs the driver's count

        device_count = torch.cuda.device_count
    return int(device_count()), "torch.cuda.device_count()"


def check_spares(gpus: int, source: str, nproc: int, spares: int) -> None:
    """Refuse, in one line, spares that would have no GPU of their own on this node."""
    if gpus > 0 and spares > 0 and nproc + spares > gpus:
        raise ConfigError(
            "spares", spares,
            f"--spares {spares} with --nproc-per-node {nproc} needs {nproc + spares} GPUs on this node, "
            f"which has {gpus} ({source}); a spare needs a GPU of its own (NCCL refuses two ranks on one "
            f"GPU). Run spares on nodes of their own (ckptless-run --nproc-per-node 0 --spares N ... "
            f"with the job's --rdzv-id and --rdzv-endpoint), or set {NODE_GPUS_VAR}=0 for a CPU job on a "
            "GPU host")


def member_gpu(local_rank: int, gpus: int) -> int | None:
    """A member's GPU: its local rank (torchrun's convention); None past the node's GPUs."""
    return local_rank if local_rank < gpus else None


def choose_gpu(gpus: int, used: Collection[int], bad: Collection[int], keep: int | None = None) -> int | None:
    """``keep`` while it is a good GPU no live worker uses, else the lowest such GPU; None: none left."""
    if keep is not None and 0 <= keep < gpus and keep not in used and keep not in bad:
        return keep
    return next((g for g in range(gpus) if g not in used and g not in bad), None)


def initial_gpus(gpus: int, nproc: int, spares: int) -> list[int | None]:
    """The first spawn: members on their local rank's GPU, each spare on the lowest GPU still free.

    (After :func:`check_spares` that is simply ``nproc + i``; the rule is written as the general one
    so that a refill or respawn applies the same.)"""
    out: list[int | None] = [member_gpu(lr, gpus) for lr in range(nproc)]
    for _ in range(spares):
        out.append(choose_gpu(gpus, {g for g in out if g is not None}, ()))
    return out


def device_env(gpu: int, virtual_local_rank: bool, parent_env: Mapping[str, str]) -> dict[str, str]:
    """``LOCAL_RANK`` (and ``CUDA_VISIBLE_DEVICES``) that put a worker on ``gpu``, as torchrun would.

    Plain: ``LOCAL_RANK=<gpu>``, the agent's ``CUDA_VISIBLE_DEVICES`` inherited. With
    ``--virtual-local-rank``: ``LOCAL_RANK=0`` and ``CUDA_VISIBLE_DEVICES`` = the agent's entry for
    ``gpu`` (or ``gpu`` itself when the agent has no list), so the worker sees that one GPU.
    """
    visible = parent_env.get("CUDA_VISIBLE_DEVICES")
    if not virtual_local_rank:
        return {"LOCAL_RANK": str(gpu)} | ({} if visible is None else {"CUDA_VISIBLE_DEVICES": visible})
    if visible is None:
        return {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": str(gpu)}
    entries = visible.split(",")  # torchrun's own parse, so members get exactly torchrun's value
    if not 0 <= gpu < len(entries):
        raise ConfigError("CUDA_VISIBLE_DEVICES", visible, f"has no entry for GPU {gpu} (it lists {len(entries)})")
    return {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": entries[gpu].strip()}


def spare_device_env(local_rank: int, gpu: int | None, virtual_local_rank: bool,
                     parent_env: Mapping[str, str]) -> dict[str, str]:
    """A spare's (or a refilled spare's) device variables.

    With a GPU: :func:`device_env` for it. Without (a CPU job): ``LOCAL_RANK`` = its slot, as it always
    was; with ``--virtual-local-rank`` ``LOCAL_RANK=0`` and an empty ``CUDA_VISIBLE_DEVICES`` (no GPU:
    said plainly, never another worker's)."""
    if gpu is not None:
        return device_env(gpu, virtual_local_rank, parent_env)
    if virtual_local_rank:
        return {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": ""}
    return {"LOCAL_RANK": str(local_rank)}
