"""PyTorch Lightning (2.6) under ckptless: one call instead of ``trainer.fit(...)``.

    job = ckptless.init()                        # before the Trainer: it makes the process group
    trainer = L.Trainer(strategy="ddp", devices=1, num_nodes=job.world_size, ...)
    ckptless.integrations.lightning.fit(trainer, model, train_dataloaders=loader)
    job.close()

Why this shape: Lightning owns its loop, creates its optimizers and DDP
wrapper inside ``fit()``, and resumes from a checkpoint dictionary
(``ckpt_path``) exactly, loops' progress included. ckptless takes the
checkpoint's place: the protected state is the very dictionary Lightning
would save (``dump_checkpoint``: the module, optimizers, schedulers, loops,
callbacks, precision plugin), captured at each optimizer step's start; after a
recovery ``fit()`` is called again with ``ckpt_path`` naming the restored
dictionary, which a wrapping ``CheckpointIO`` plugin hands over from memory.

The one thing Lightning's own resume gets wrong mid-epoch is the data: it
saves a stateful loader's state *after* its prefetch, and a plain
``DataLoader`` not at all. So each training loader is wrapped
(:class:`ResumableLoader`) in ckptless's exact pass reopening
(:mod:`ckptless.passes`): its state is the batch the step in hand trained,
and the pass is reopened there with the same order. The RNG streams are put
back to the resume version's at its first step.

Requirements (each refused with a ``ConfigError`` naming it): one training
loader passed to ``fit()`` (not through a ``LightningDataModule``), already
sharded (a ``DistributedSampler``: Lightning does not inject one through the
wrapper), no ``ckpt_path``. Not yet covered: a recovery right after a
validation inside an epoch (``val_check_interval`` < 1), ``seed_everything(workers=True)``
(the wrapper is not a ``DataLoader``, so Lightning does not set its ``worker_init_fn``). Tested bitwise in CI by ``ckptless-chaos run kill-twice
--script examples/lightning_train.py`` (tests/e2e/test_integrations_e2e.py). A new DDP wrapper is built by
each ``fit()`` call on every rank (Lightning tears its wrapper down when a
failure leaves ``fit()``), so the reducer's buckets start fresh after a
recovery: bitwise at two ranks (a sum of two numbers has one order), not
guaranteed beyond.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, DistributedSampler

from ckptless.errors import ConfigError
from ckptless.job import Job, current
from ckptless.passes import LoopPosition, open_pass
from ckptless.state import RNGState

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import CheckpointIO
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError("ckptless.integrations.lightning needs lightning: pip install 'ckptless[lightning]'") from exc

__all__ = ["ResumableLoader", "fit"]

MEMORY = "ckptless://memory"  # the ckpt_path of a resume from the restored state


class ResumableLoader:
    """A training loader whose state is the batch the step in hand trains (Lightning sees it as stateful).

    ``sampler``/``batch_sampler``/``dataset``/``batch_size`` are the wrapped loader's, so Lightning's
    ``set_epoch`` reaches its sampler; ``len`` is its length.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.position = LoopPosition()
        self._reopen: dict[str, Any] | None = None  # the resume version's RNG streams: reopen there

    def __getattr__(self, name: str) -> Any:
        if name in ("sampler", "batch_sampler", "dataset", "batch_size", "num_workers", "drop_last"):
            return getattr(self.loader, name)
        raise AttributeError(name)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        resume, self._reopen = self._reopen, None
        if resume is None:
            self.position.next_pass()
        return self._pass(resume)

    def _pass(self, resume: dict[str, Any] | None) -> Iterator[Any]:
        # Opened at the first batch, not at iter(): Lightning makes its iterator before it calls the
        # sampler's set_epoch (a DataLoader, too, reads the sampler only when its first batch is asked for).
        yield from open_pass(self.loader, self.position, resume)

    def at_batch(self, batch_idx: int) -> None:
        """The step in hand trains batch ``batch_idx`` of the pass: what a capture now records."""
        self.position.consumed = batch_idx

    def state_dict(self) -> dict[str, Any]:
        return self.position.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position.load_state_dict(state)
        self._reopen = RNGState().state_dict() if self.position.opened else None


class _MemoryCheckpointIO(CheckpointIO):
    """Hands Lightning the restored checkpoint dictionary for ``ckpt_path=MEMORY``; the rest goes to the
    plugin it wraps."""

    def __init__(self, inner: CheckpointIO, run: _Run) -> None:
        self.inner, self.run = inner, run

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> dict[str, Any]:
        if str(path) == MEMORY:
            assert self.run.restored is not None
            return self.run.restored
        return self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


class _LightningState:
    """The checkpoint dictionary Lightning would save, as one Stateful (restored: handed to fit())."""

    def __init__(self, run: _Run) -> None:
        self.run = run

    def state_dict(self) -> dict[str, Any]:
        trainer = self.run.trainer
        if trainer.lightning_module is None:  # before the first fit(): the module's weights, nothing else yet
            return {"present": False, "checkpoint": {"state_dict": self.run.model.state_dict()}}
        ckpt = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        _settle_batch_progress(ckpt)
        for key in [k for k in ckpt if k.startswith("hyper_parameters") or k.startswith("hparams")]:
            ckpt.pop(key)  # the script's constant configuration, rebuilt by its setup
        return {"present": True, "checkpoint": _plain(ckpt)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd["present"]:
            self.run.restored = sd["checkpoint"]
            return
        self.run.restored = None  # version 0: the first fit() starts from these weights
        self.run.model.load_state_dict(sd["checkpoint"]["state_dict"])


def _settle_batch_progress(ckpt: dict[str, Any]) -> None:
    """Captured at a batch's start, Lightning's counters hold that batch as "ready" (fetched, not
    started). Resumed from there it would count it twice; the batch is fetched again after a
    restore, so the image records it as not fetched: every counter at the batches completed."""
    progress = ckpt.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
    if not isinstance(progress, dict):
        return
    for part in ("total", "current"):
        counts = progress.get(part)
        if isinstance(counts, dict) and counts.get("ready") == counts.get("started", -2) + 1:
            counts["ready"] -= 1


def _plain(obj: Any) -> Any:
    """Containers as plain dicts and lists (a checkpoint holds a few dict subclasses and tuples)."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


class _Boundary(pl.Callback):
    """Each optimizer step's first batch closes the step before (its version captured and mirrored)."""

    def __init__(self, run: _Run) -> None:
        self.run = run

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self.run.step_begins(batch_idx)


class _Run:
    def __init__(self, job: Job, trainer: pl.Trainer, model: pl.LightningModule, loader: ResumableLoader) -> None:
        self.job, self.trainer, self.model, self.loader = job, trainer, model, loader
        self.restored: dict[str, Any] | None = None
        self._rng: dict[str, Any] | None = None

    def call(self, model: pl.LightningModule, fit_kwargs: dict[str, Any]) -> Any:
        gc.collect()  # the DDP wrapper a failed fit() left: its reducer's hooks go with it
        self._rng = RNGState().state_dict()
        ckpt = MEMORY if self.restored is not None else None
        return self.trainer.fit(model, ckpt_path=ckpt, **fit_kwargs)

    def step_begins(self, batch_idx: int) -> None:
        self.loader.at_batch(batch_idx)
        if self._rng is not None:  # this call's first step: the streams as the resume version had them
            RNGState().load_state_dict(self._rng)
            self._rng = None
        self.job.begin_step()


def fit(trainer: pl.Trainer, model: pl.LightningModule, train_dataloaders: Any = None, val_dataloaders: Any = None,
        **fit_kwargs: Any) -> Any:
    """``trainer.fit(model, train_dataloaders, val_dataloaders, **fit_kwargs)``, protected and recovered."""
    if not isinstance(trainer, pl.Trainer):
        raise ConfigError("trainer", type(trainer).__name__, "must be a lightning.pytorch.Trainer")
    for field in ("ckpt_path", "datamodule"):
        if fit_kwargs.get(field) is not None:
            raise ConfigError(field, fit_kwargs[field], "pass the training loaders to fit() directly; ckptless "
                                                        "resumes the Trainer itself")
    if train_dataloaders is None or isinstance(train_dataloaders, (list, tuple, dict)):
        raise ConfigError("train_dataloaders", type(train_dataloaders).__name__, "pass one training loader to "
                          "fit() (several are not resumed exactly yet)")
    job = current()
    sampler = getattr(train_dataloaders, "sampler", None)
    if job.world_size > 1 and isinstance(train_dataloaders, DataLoader) and not isinstance(sampler, DistributedSampler):
        raise ConfigError("train_dataloaders", type(sampler).__name__, "give the loader a DistributedSampler: "
                          "Lightning does not inject one through ckptless's wrapper, and each rank would train on "
                          "the whole dataset")
    run = _Run(job, trainer, model, ResumableLoader(train_dataloaders))
    trainer.strategy.checkpoint_io = _MemoryCheckpointIO(trainer.strategy.checkpoint_io, run)
    trainer.callbacks.append(_Boundary(run))  # type: ignore[attr-defined]
    job.protect(lightning=_LightningState(run))
    return job.train(run.call, model, {"train_dataloaders": run.loader, "val_dataloaders": val_dataloaders,
                                       **fit_kwargs})
