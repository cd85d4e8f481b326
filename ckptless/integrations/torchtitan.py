"""torchtitan (0.3) under ckptless: one call instead of ``trainer.train()``.

    job = ckptless.init()                        # before the Trainer: it makes the process group
    trainer = config.build()                     # torchtitan's Trainer, as its train.py builds it
    ckptless.integrations.torchtitan.train(trainer)   # instead of trainer.train()
    trainer.close()
    job.close()

Why this shape: torchtitan's ``Trainer`` already names everything a resume needs as
``torch.distributed.checkpoint`` Stateful objects, the ones its ``CheckpointManager`` saves
(trainer.py, ``config.checkpoint.build(dataloader=..., model_parts=..., optimizers=...,
lr_schedulers=..., states={"train_state": self})``). ckptless protects those very objects, in memory,
and runs the same loop as ``Trainer.train()`` (trainer.py, ``train``: the step counter, ``train_step``,
the checkpointer's ``save``, validation, the profiler) with :meth:`ckptless.job.Job.begin_step` at each
step's start, so version *k* is the state after *k* optimizer steps, their disk save and validation.

What is protected, and how it differs from what the ``CheckpointManager`` saves:

* ``model``: the model part as built (FSDP2 ``fully_shard`` by ``parallelize_fn``): its sharded
  ``state_dict`` (DTensors), the FSDP2 path of :mod:`ckptless.state.fsdp` (a survivor's half-run
  forward/backward is reset there), not ``ModelWrapper``'s flattened cache;
* ``optimizer`` (``optimizer_<i>`` when there are several): each optimizer the ``OptimizersContainer``
  holds, not the container: its ``state_dict()`` materializes an optimizer's state with a zero-lr step
  when it has none (``init_optim_state``), which moves Adam's ``step`` count: a capture before the first
  step would change what that step computes. The capture's step pre-hook goes on each of them;
* ``lr_scheduler``: the ``LRSchedulersContainer`` (its ``state_dict`` is its first scheduler's; its
  ``load_state_dict`` loads every one, as for a checkpoint);
* ``dataloader``: torchtitan's ``ParallelAwareDataloader`` (a torchdata ``StatefulDataLoader``) through
  :class:`LoaderState` (its state unpickled); its state is its position after the batches the trained steps consumed (``train_step`` takes
  ``gradient_accumulation_steps`` batches, all inside one ckptless step: no accumulation window spans a
  version); after a recovery the loop makes a new iterator, which resumes there;
* ``train_state``: ``Trainer.state_dict()`` (``step``, ``ntokens_seen``); and the RNG streams, as for any
  job.

Its ``CheckpointManager`` stays what it was, the disk tier: ``load()`` at the job's first start (never
after a recovery: the state then is ckptless's), ``save()`` after each step as ``train()`` does, so
``checkpoint.interval`` still writes DCP checkpoints (``--checkpoint.enable false`` turns it off; a
job ckptless cannot recover, all holders of a rank's image lost, restarts from ckptless's own snapshot
or from that checkpoint). Not run here: ``set_pg_timeouts`` after the first step (ckptless detects
failures and owns the groups' deadlines) and the rank-0 sleep at the end.

Cost to know (docs/scale.md): llama3's fused QKV (``fuse_qkv=True``, its default) registers a
``state_dict`` hook that gathers each layer's ``wqkv`` to Replicate over the FSDP group, so every capture
runs that all-gather and the image holds the QKV weights replicated (W times their sharded size). Bitwise
at 2 ranks here; protecting the raw sharded parameters (torchtitan's own checkpoints need the hook) is
the fix not made yet.

Refused (``ConfigError``): pipeline parallelism (several model parts and a schedule whose in-flight
state a survivor would carry; untested), CUDA graphs (``fwd_bwd_fn`` replays captured pointers:
``--training.disable_cuda_graphs``), TorchFT. Not in the image: the validator's loader (0.3 reads it from
its start at each validation), the metrics' running counters (throughput), DTensor's RNG tracker
(random ops on DTensors under TP: llama3 has none). torchtitan's ``init_distributed`` is skipped (the
group exists): its NCCL flight-recorder variables are not set; the autograd-multithreading switch the
``spmd_types`` backend needs is made here.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any

import torch

from ckptless import sample_seeds
from ckptless.errors import ConfigError
from ckptless.job import Job, current

try:
    from torchtitan.components.dataloader import DataloaderExhaustedError
    from torchtitan.trainer import Trainer
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError("ckptless.integrations.torchtitan needs torchtitan: pip install 'ckptless[torchtitan]'") from exc

__all__ = ["LoaderState", "TrainState", "protect", "stateful_objects", "train"]

log = logging.getLogger(__name__)


class LoaderState:
    """torchtitan's loader (a ``BaseDataLoader``) as the image holds it: ``ParallelAwareDataloader.state_dict()``
    pickles its ``StatefulDataLoader`` state into ``bytes`` ("for backward compatibility" with DCP
    checkpoints), which the image does not hold as such; here each pickled value is its unpickled
    structure (ints, lists, tensors: compared and checksummed as the rest), pickled again for
    ``load_state_dict``. The loader's position is the data position (``__ckptless_data_position__``).

    The one ``pickle.loads`` here reads only the bytes this process's own loader has just made in
    ``state_dict()``; what crosses the network or reaches disk is the unpickled structure, in the
    image's typed encoding, never pickled bytes (a peer's image is decoded without unpickling)."""

    __ckptless_data_position__ = True

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._loaded = False

    def state_dict(self) -> dict[str, Any]:
        # A StatefulDataLoader's state_dict() right after load_state_dict() makes the iterator that
        # resumes there, and a DataLoader iterator draws its base seed from torch's stream (or the
        # loader's generator) when made: the capture a restore is followed by would draw once more than
        # the fault-free run, whose one draw (its first capture's) is in every version already.
        saved = _streams(self.loader) if self._loaded else None
        self._loaded = False
        sd = self.loader.state_dict()
        if saved is not None:
            _put_back(self.loader, saved)
        return {"pickled": sorted(k for k, v in sd.items() if isinstance(v, bytes)),
                "state": {k: pickle.loads(v) if isinstance(v, bytes) else v for k, v in sd.items()}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pickled = set(sd["pickled"])
        self.loader.load_state_dict({k: pickle.dumps(v) if k in pickled else v for k, v in sd["state"].items()})
        self._loaded = True


def _streams(loader: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The streams a DataLoader iterator draws its base seed from: torch's, and the loader's generator."""
    gen = getattr(loader, "generator", None)
    return torch.get_rng_state(), None if gen is None else gen.get_state()


def _put_back(loader: Any, saved: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    torch.set_rng_state(saved[0])
    gen = getattr(loader, "generator", None)
    if gen is not None and saved[1] is not None:
        gen.set_state(saved[1])


class TrainState:
    """``Trainer.state_dict()`` (``step``, ``ntokens_seen``: what ``CheckpointManager`` saves as
    ``train_state``) as a Stateful of its own: the Trainer object itself is not handed to the registry."""

    __ckptless_data_position__ = False  # the loader is the position; this only counts steps

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return {k: int(v) for k, v in self.trainer.state_dict().items()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.trainer.load_state_dict(dict(sd))


def stateful_objects(trainer: Trainer) -> dict[str, Any]:
    """What :func:`protect` protects, by name (module doc): the Trainer's own objects, not copies."""
    optimizers = list(trainer.optimizers.optimizers)
    named_optimizers = ({"optimizer": optimizers[0]} if len(optimizers) == 1
                        else {f"optimizer_{i}": o for i, o in enumerate(optimizers)})
    return {"model": trainer.model_parts[0], **named_optimizers, "lr_scheduler": trainer.lr_schedulers,
            "dataloader": LoaderState(trainer.dataloader), "train_state": TrainState(trainer)}


def check_supported(trainer: Trainer) -> None:
    """Refuse, with a ``ConfigError`` naming the setting, what this integration does not cover."""
    if not isinstance(trainer, Trainer):
        raise ConfigError("trainer", type(trainer).__name__, "must be a torchtitan.trainer.Trainer")
    config = trainer.config
    if trainer.parallel_dims.pp_enabled or len(trainer.model_parts) != 1:
        raise ConfigError("parallelism.pipeline_parallel_degree", config.parallelism.pipeline_parallel_degree,
                          "pipeline parallelism is not supported by ckptless.integrations.torchtitan yet")
    if getattr(trainer, "fwd_bwd_fn", None) != trainer._forward_backward_body:
        raise ConfigError("training.disable_cuda_graphs", config.training.disable_cuda_graphs,
                          "a CUDA-graphed forward/backward replays the pointers it captured; a recovery "
                          "restores state it cannot see: run with --training.disable_cuda_graphs")
    if type(trainer).__module__.startswith("torchtitan.experiments.torchft"):
        raise ConfigError("trainer", type(trainer).__name__, "TorchFT's trainer recovers by itself; use one or "
                                                             "the other")


def protect(trainer: Trainer, job: Job | None = None) -> dict[str, Any]:
    """Protect ``trainer``'s Stateful objects (module doc) with ``job`` (the current one); return them."""
    check_supported(trainer)
    job = job or current()
    objs = stateful_objects(trainer)
    # What job.protect does for a loader it is handed (here it gets the adapter): refuse persistent
    # workers a recovery cannot reproduce, seed the workers per sample before the first state_dict().
    sample_seeds.refuse_unreproducible(trainer.dataloader, "dataloader")
    sample_seeds.install(trainer.dataloader)
    job.protect(**objs)
    return objs


class _Loop:
    """``Trainer.train()``'s loop, one ckptless step per optimizer step; called again after a recovery."""

    def __init__(self, job: Job, trainer: Trainer) -> None:
        self.job, self.trainer = job, trainer
        self.calls = 0

    def __call__(self) -> None:
        t, config = self.trainer, self.trainer.config
        self.calls += 1
        first_start = self.calls == 1 and self.job.generation == 0 and self.job.recoveries == 0
        if first_start:
            # The job's first start: torchtitan's own resume from disk (a no-op without a checkpoint).
            # Never after a recovery, nor in a replacement: the state then is the resume version's.
            t.checkpointer.load(step=config.checkpoint.load_step)
        with config.profiler.build(global_step=t.step, base_folder=config.dump_folder) as profiler:
            data_iterator = t.batch_generator(self._iterator(first_start))
            while t.should_continue_training():
                self.job.begin_step()
                t.step += 1
                t.gc_handler.run(t.step)
                try:
                    t.train_step(data_iterator)
                except DataloaderExhaustedError:
                    log.warning("torchtitan: ran out of data; step %d was canceled", t.step)
                    break
                t.checkpointer.save(t.step, last_step=(t.step == config.training.steps))
                if config.validator.enable and t.validator.should_validate(t.step):
                    t.validator.validate(t.model_parts, t.step)
                profiler.step()

    def _iterator(self, first_start: bool) -> Any:
        """A new iterator over the loader, which resumes at the loader's (restored) state, made before
        the first step: making one draws a base seed (torch's stream, or the loader's generator), a draw
        the fault-free run made once, before its first version (its first capture's ``state_dict()``
        makes the iterator ``iter()`` then takes). After a recovery that draw is in the restored streams
        already: the new iterator's own is undone (:class:`LoaderState` does the same for the capture)."""
        loader = self.trainer.dataloader
        saved = None if first_start else _streams(loader)
        it = iter(loader)
        if saved is not None:
            _put_back(loader, saved)
        return it


def train(trainer: Trainer) -> None:
    """``trainer.train()``, protected and recovered (module doc)."""
    job = current()
    protect(trainer, job)
    if trainer.config.parallelism.spmd_backend == "spmd_types":
        # What torchtitan's init_distributed does before making the group (ckptless.init() made it):
        # backward's recompute under activation checkpointing reads the mesh from thread-local state.
        torch.autograd.set_multithreading_enabled(False)
    job.train(_Loop(job, trainer))
