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
wrapper), no ``ckpt_path``. Not yet covered: ``seed_everything(workers=True)``
(the wrapper is not a ``DataLoader``, so Lightning does not set its ``worker_init_fn``).

At any world size (issue 38): each ``fit()`` builds a new DDP wrapper, whose
reducer is given the resume version's bucket layout (:meth:`_Run.fit_started`),
and a survivor's Trainer is put back to what a replacement's starts from
(:class:`_Fresh`), so both run the same collectives. Tested bitwise in CI at 4
ranks with a val loader (tests/e2e/test_lightning_e2e.py) and at 2
(tests/e2e/test_integrations_e2e.py).
"""

from __future__ import annotations

import copy
import enum
import gc
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler

from ckptless.errors import ConfigError
from ckptless.job import Job, current
from ckptless.passes import LoopPosition, open_pass
from ckptless.state import DDPReducerState, RNGState
from ckptless.worker import groups

try:
    import lightning.pytorch as pl
    from lightning.fabric.plugins import CheckpointIO
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loops.loop import _Loop
    from lightning.pytorch.loops.progress import _BaseProgress
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError("ckptless.integrations.lightning needs lightning: pip install 'ckptless[lightning]'") from exc

__all__ = ["ResumableLoader", "fit"]

log = logging.getLogger(__name__)
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
    """One part of the checkpoint dictionary Lightning would save (restored: handed to the next fit()).

    Three parts, protected under three names, so that a verdict that differs names what differs:
    ``lightning`` (loops, callbacks, schedulers, the loader's position, the DDP reducer's layout),
    ``lightning_module`` (the module's ``state_dict``), ``lightning_optimizers``. The dictionary is
    dumped once per capture (:meth:`_Run.dump`)."""

    PARTS = {"lightning": None, "lightning_module": "state_dict", "lightning_optimizers": "optimizer_states"}

    def __init__(self, run: _Run, name: str) -> None:
        self.run, self.name, self.key = run, name, self.PARTS[name]

    def state_dict(self) -> dict[str, Any]:
        ckpt = self.run.dump()
        if ckpt is None:  # before the first fit(): the module's weights, nothing else yet
            return {"present": False, "part": self.run.model.state_dict() if self.key == "state_dict" else {}}
        if self.key is not None:
            return {"present": True, "part": ckpt[self.key]}
        rest = {k: v for k, v in ckpt.items() if k not in ("state_dict", "optimizer_states")}
        return {"present": True, "part": rest, "ddp": self.run.reducer_state()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.run.loaded[self.name] = sd


def _settle_batch_progress(ckpt: dict[str, Any]) -> None:
    """Captured at a batch's start, Lightning's counters hold that batch as "ready" (fetched, not
    started). Resumed from there it would count it twice; the batch is fetched again after a
    restore, so the image records it as not fetched: every counter at the batches completed."""
    progress = ckpt.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
    if not isinstance(progress, dict):
        return
    settled = False
    for part in ("total", "current"):
        counts = progress.get(part)
        if isinstance(counts, dict) and counts.get("ready") == counts.get("started", -2) + 1:
            counts["ready"] -= 1
            settled = True
    if settled:  # the fetch of an epoch's last batch said "last": not fetched yet, nothing is last
        progress["is_last_batch"] = False


CWD = "{ckptless:cwd}"  # an absolute path under the working directory, in the image


def _paths_out(obj: Any, cwd: str) -> Any:
    """Containers as plain dicts and lists (a checkpoint holds a few dict subclasses and tuples), and a
    path under the working directory relative to it: a ``ModelCheckpoint`` keeps absolute paths (its
    ``dirpath``, ``best_model_path``) that name the run's directory, not the training's state."""
    if isinstance(obj, dict):
        return {_paths_out(k, cwd): _paths_out(v, cwd) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_paths_out(v, cwd) for v in obj]
    if isinstance(obj, str) and (obj == cwd or obj.startswith(cwd + os.sep)):
        return CWD + obj[len(cwd):]
    return obj


def _paths_in(obj: Any, cwd: str) -> Any:
    if isinstance(obj, dict):
        return {_paths_in(k, cwd): _paths_in(v, cwd) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_paths_in(v, cwd) for v in obj]
    if isinstance(obj, str) and obj.startswith(CWD):
        return cwd + obj[len(CWD):]
    return obj


def _is_plain(v: Any) -> bool:
    """A value a fresh copy of the object holds by itself (no reference to the trainer, a module, data)."""
    if v is None or isinstance(v, (bool, int, float, str, enum.Enum, _BaseProgress)):
        return True
    if isinstance(v, (list, tuple)):
        return all(_is_plain(x) for x in v)
    if type(v) is dict:
        return all(_is_plain(k) and _is_plain(x) for k, x in v.items())
    return isinstance(v, _ResultCollection) and not v


class _Fresh:
    """What a replacement's first ``fit()`` starts from, put back before a survivor's next one.

    Why (issue 38): a replacement runs the script's setup and then ``fit()`` on a new Trainer; a
    survivor calls ``fit()`` again on the Trainer its failed call left. Lightning keeps state that is
    in no checkpoint on its loops, callbacks and Trainer (``ModelCheckpoint._last_global_step_saved``,
    the validation loop's ``_has_run``, ``trainer.should_stop``, logged results), and branches on it
    to run collectives or not (a checkpoint's save: a barrier and broadcasts; a validation): the
    survivors and the replacement then sat in different collectives until Gloo's timeout, generation
    after generation. So the plain attributes (numbers, flags, strings, progress counters, empty
    result collections) of the Trainer, its strategy, every loop and every callback are recorded
    just before ``trainer.fit`` is first called, and put back (those added since removed; an object
    set since in place of a plain value kept) before each later call.
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        objs: list[Any] = [trainer, trainer.strategy, *trainer.callbacks]  # type: ignore[attr-defined]
        todo: list[Any] = [trainer.fit_loop, trainer.validate_loop, trainer.test_loop, trainer.predict_loop]
        while todo:
            loop = todo.pop()
            objs.append(loop)
            todo.extend(v for k, v in vars(loop).items() if isinstance(v, _Loop) and k != "trainer")
        self.saved = [(o, {k: copy.deepcopy(v) for k, v in vars(o).items() if _is_plain(v)}) for o in objs]

    def restore(self) -> None:
        for obj, attrs in self.saved:
            now = vars(obj)
            for k in [k for k, v in now.items() if k not in attrs and _is_plain(v)]:
                delattr(obj, k)
            for k, v in attrs.items():
                if k not in now or _is_plain(now[k]):  # an object set since (a plugin, a loader) stays
                    setattr(obj, k, copy.deepcopy(v))


class _Boundary(pl.Callback):
    """Each optimizer step's first batch closes the step before (its version captured and mirrored)."""

    def __init__(self, run: _Run) -> None:
        self.run = run

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.run.fit_started(trainer.strategy.model)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self.run.step_begins(batch_idx)


def _mean_as_gloo_does() -> None:
    """Lightning averages over Gloo as SUM then a division, because Gloo has no integer AVG; it
    recognises Gloo by the backend's name, and a ckptless group's is ``ckptless``: every
    ``self.log(..., sync_dist=True)`` of a mean failed at its first validation (an AVG all-reduce of
    the Long batch-size count: "result type Float can't be cast to the desired output type Long").
    So a mean of a CPU tensor is reduced as Lightning reduces it over Gloo (its own code, op "sum")."""
    from lightning.fabric.utilities import distributed as fd

    inner = fd._sync_ddp
    if getattr(inner, "ckptless", False):
        return

    def sync(result: Any, group: Any = None, reduce_op: Any = None) -> Any:
        if isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg") and result.device.type == "cpu":
            out = inner(result, group=group, reduce_op="sum")
            size = torch.distributed.get_world_size(group)
            return out.copy_(out / size) if not torch.is_floating_point(out) else out.div_(size)
        return inner(result, group=group, reduce_op=reduce_op)

    sync.ckptless = True  # type: ignore[attr-defined]
    fd._sync_ddp = sync


class _Run:
    def __init__(self, job: Job, trainer: pl.Trainer, model: pl.LightningModule, loader: ResumableLoader) -> None:
        self.job, self.trainer, self.model, self.loader = job, trainer, model, loader
        self.restored: dict[str, Any] | None = None
        self.loaded: dict[str, dict[str, Any]] = {}  # the parts a restore handed over, by name
        self._rng: dict[str, Any] | None = None
        self._dump: dict[str, Any] | None = None  # this capture's dictionary (one dump for the three parts)
        self._reducer: DDPReducerState | None = None  # this fit()'s DDP reducer, tracked
        self._reducer_image: dict[str, Any] | None = None  # the restored layout, for the next fit()'s DDP
        self._stepped: int | None = None  # the resume version's _batches_that_stepped, for this call's first step
        self._cwd = os.getcwd()
        self._fresh: _Fresh | None = None  # recorded at the first call, after fit() set up the Trainer
        self._said = False

    def dump(self) -> dict[str, Any] | None:
        """Lightning's checkpoint dictionary now (None before the first fit() made a module its own)."""
        if self.trainer.lightning_module is None:
            return None
        if self._dump is None:
            ckpt = self.trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            _settle_batch_progress(ckpt)
            for key in [k for k in ckpt if k.startswith("hyper_parameters") or k.startswith("hparams")]:
                ckpt.pop(key)  # the script's constant configuration, rebuilt by its setup
            self._dump = _paths_out(ckpt, self._cwd)
        return self._dump

    def reducer_state(self) -> dict[str, Any] | None:
        return None if self._reducer is None else self._reducer.state_dict()

    def _take_restored(self) -> None:
        """The parts a restore loaded, as the checkpoint dictionary the next fit() resumes from."""
        parts, self.loaded = self.loaded, {}
        if not parts:
            return
        main = parts["lightning"]
        if not main["present"]:  # version 0: the first fit() starts from these weights
            self.restored, self._reducer_image = None, None
            self.model.load_state_dict(parts["lightning_module"]["part"])
            return
        ckpt = _paths_in(main["part"], self._cwd)
        ckpt["state_dict"] = parts["lightning_module"]["part"]
        ckpt["optimizer_states"] = parts["lightning_optimizers"]["part"]
        self.restored, self._reducer_image = ckpt, main.get("ddp")

    def call(self, model: pl.LightningModule, fit_kwargs: dict[str, Any]) -> Any:
        self._take_restored()
        if self._reducer is not None:
            self._reducer.close()
            self._reducer = None
        if self._fresh is None:
            self._fresh = _Fresh(self.trainer)
        else:
            self._fresh.restore()  # what a replacement's Trainer holds at its first fit()
        if self.restored is not None:
            # The resumed steps save again the files the abandoned ones saved, under the same names, where
            # Lightning would add "-v1" (a state that differs from the fault-free run's): overwritten instead.
            for cb in self.trainer.checkpoint_callbacks:
                if isinstance(cb, ModelCheckpoint):
                    cb._enable_version_counter = False
        gc.collect()  # the DDP wrapper a failed fit() left: its reducer's hooks go with it
        self._rng = RNGState().state_dict()
        self._stepped = None if self.restored is None else \
            self.restored.get("loops", {}).get("fit_loop", {}).get("epoch_loop.state_dict", {}).get("_batches_that_stepped")
        ckpt = MEMORY if self.restored is not None else None
        self._dump = None
        try:
            return self.trainer.fit(model, ckpt_path=ckpt, **fit_kwargs)
        finally:
            self._dump = None

    def fit_started(self, wrapped: Any) -> None:
        """The fit()'s DDP wrapper exists: track its reducer; after a recovery, give it the resume version's
        bucket layout. Why: each fit() builds a new DDP whose buckets start in the constructor's layout and
        are rebuilt after its first step in gradient-ready order; the gradients of a parameter are summed in
        the order its place in a bucket gives, so a resumed run at more than two ranks summed them in
        another order than the fault-free run for a step (different bits). Replayed locally
        (:mod:`ckptless.state.ddp`), every rank from its own image."""
        image, self._reducer_image = self._reducer_image, None
        if not isinstance(wrapped, DistributedDataParallel):
            return
        try:
            self._reducer = DDPReducerState(wrapped, "lightning")
        except ConfigError as exc:  # e.g. find_unused_parameters=True: trains, recovers, not bitwise beyond 2 ranks
            if not self._said:
                log.warning("ckptless: a resumed step may sum gradients in another order than the fault-free run "
                            "(bits differ beyond 2 ranks): %s", exc)
                self._said = True
            return
        if image is not None:
            with groups.local_only():
                self._reducer.load_state_dict(image)

    def step_begins(self, batch_idx: int) -> None:
        self._dump = None
        self.loader.at_batch(batch_idx)
        if self._rng is not None:  # this call's first step: the streams as the resume version had them
            RNGState().load_state_dict(self._rng)
            self._rng = None
        if self._stepped is not None:
            # Lightning counts one more "batch that stepped" when it restarts from a checkpoint saved after a
            # batch's end (its logging step); this one was taken before the batch: the count as captured
            self.trainer.fit_loop.epoch_loop._batches_that_stepped = self._stepped
            self._stepped = None
        self.job.begin_step()
        self._dump = None


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
    _mean_as_gloo_does()
    run = _Run(job, trainer, model, ResumableLoader(train_dataloaders))
    trainer.strategy.checkpoint_io = _MemoryCheckpointIO(trainer.strategy.checkpoint_io, run)
    trainer.callbacks.append(_Boundary(run))  # type: ignore[attr-defined]
    job.protect(**{name: _LightningState(run, name) for name in _LightningState.PARTS})
    return job.train(run.call, model, {"train_dataloaders": run.loader, "val_dataloaders": val_dataloaders,
                                       **fit_kwargs})
