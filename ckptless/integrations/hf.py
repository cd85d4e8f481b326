"""Hugging Face ``transformers.Trainer`` (5.x) under ckptless: one call instead of ``trainer.train()``.

    job = ckptless.init()                       # before TrainingArguments: it makes the process group
    trainer = Trainer(model=model, args=args, train_dataset=ds, ...)
    ckptless.integrations.hf.train(trainer)     # instead of trainer.train()
    job.close()

Why this shape: the Trainer owns its loop, its optimizer and scheduler (made
inside ``train()``), its DDP wrapper and its data position (``global_step``,
from which it skips batches when it resumes from a checkpoint). ckptless
keeps all of that and takes the checkpoint's place: what the Trainer would
read from a checkpoint directory it gets from the restored, in-memory state.

How:

* every optimizer step is one ckptless step; the boundary is the Trainer's
  ``on_step_begin`` callback, so version *k* is the state after *k* optimizer
  steps *and* the logging, evaluation and saving that followed the last one;
* protected: the model (wrapped in DDP here, before ``train()``, so the
  reducer's state is protected too and the Trainer keeps the wrapper), the
  optimizer (created here, before ``train()``), the LR scheduler (resolved at
  each capture: the Trainer makes a new one per ``train()`` call), the
  ``TrainerState`` (``global_step``, ``epoch``, the log history without its
  wall-clock fields, stateful callbacks) with the loss accumulated since the
  last log line, and every RNG stream;
* after a recovery ``train()`` is called again with
  ``resume_from_checkpoint`` pointing at a directory that holds only
  ``trainer_state.json`` (the restored ``TrainerState``, a few KB, in a
  private temporary directory): the Trainer computes the epoch and the batches
  to skip from it as for any checkpoint; the model, optimizer and scheduler
  loaders are taken over (the state is already in memory) and the RNG streams
  are put back to the resume version's at the first step.

Exact where the Trainer's own checkpoint resume is exact (its seedable
sampler, ``skip_first_batches``); tested bitwise in CI by
``ckptless-chaos run kill-twice --script examples/hf_trainer.py`` (tests/e2e/test_integrations_e2e.py).
Not covered: DeepSpeed, FSDP through the Trainer, SageMaker MP, a GradScaler
(``fp16``), ``auto_find_batch_size``, ``model_init``/hyperparameter search.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ckptless.errors import ConfigError
from ckptless.job import Job, current
from ckptless.state import RNGState

try:
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_callback import ExportableState, TrainerState
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError("ckptless.integrations.hf needs transformers: pip install 'ckptless[hf]'") from exc

__all__ = ["train"]

_WALL_CLOCK = ("_runtime", "_per_second")  # log fields that differ between any two runs


class _Scheduler:
    """The Trainer's LR scheduler as a Stateful, resolved at each capture and restore (a new one per train())."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.pending: dict[str, Any] | None = None  # restored before the Trainer made its scheduler

    def state_dict(self) -> dict[str, Any]:
        sched = self.trainer.lr_scheduler
        return {"present": sched is not None, "state": sched.state_dict() if sched is not None else {}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pending = sd["state"] if sd["present"] else None
        if self.pending is not None and self.trainer.lr_scheduler is not None:
            self.trainer.lr_scheduler.load_state_dict(self.pending)


class _State:
    """The ``TrainerState`` and the loss accumulated since the last log line, as one Stateful."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.restored: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        kept: dict[str, Any] = {}
        for cb in [*t.callback_handler.callbacks, t.control]:
            if isinstance(cb, ExportableState):
                kept.setdefault(type(cb).__name__, []).append(cb.state())
        t.state.stateful_callbacks = kept  # type: ignore[assignment]
        doc = dataclasses.asdict(t.state)  # a deep copy: the filter below leaves the Trainer's own alone
        doc["log_history"] = [{k: v for k, v in entry.items() if not k.endswith(_WALL_CLOCK)}
                              for entry in doc.get("log_history", [])]
        tr_loss = getattr(t, "_tr_loss", None)
        return {"json": json.dumps(doc, sort_keys=True),
                "tr_loss": tr_loss.detach().clone() if isinstance(tr_loss, torch.Tensor) else torch.zeros(()),
                "total_loss": float(getattr(t, "_total_loss_scalar", 0.0)),
                "last_logged": int(getattr(t, "_globalstep_last_logged", 0)),
                "flos": float(getattr(t, "current_flos", 0.0))}  # counted per step, added to the state at a log

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.restored = sd
        t = self.trainer
        t.state = TrainerState(**json.loads(sd["json"]))
        # The callbacks' own state (an EarlyStoppingCallback's patience counter, the TrainerControl flags),
        # put back in place: the Trainer restores it only with restore_callback_states_from_checkpoint.
        saved: dict[str, Any] = dict(t.state.stateful_callbacks or {})  # type: ignore[arg-type]
        for name, states in saved.items():
            same = [cb for cb in [*t.callback_handler.callbacks, t.control]
                    if isinstance(cb, ExportableState) and type(cb).__name__ == name]
            for cb, state in zip(same, states if isinstance(states, list) else [states]):
                for attribute, value in dict(state.get("attributes", {})).items():
                    setattr(cb, attribute, value)

    def restore_accumulators(self) -> None:
        """After ``train()`` reset them: the loss accumulated since the last log line, as it was."""
        sd, t = self.restored, self.trainer
        if sd is None:
            return
        t._tr_loss = sd["tr_loss"].to(t.args.device)
        t._total_loss_scalar = sd["total_loss"]
        t._globalstep_last_logged = sd["last_logged"]
        t.current_flos = sd["flos"]
        # The run's final train_loss averages over the steps since this call began: since the job's start.
        t._initial_global_step = 0


class _Boundary(TrainerCallback):
    """Each optimizer step's start closes the step before (its version captured and mirrored)."""

    def __init__(self, run: _Run) -> None:
        self.run = run

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.run.state.restore_accumulators()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.run.step_begins()


class _ResumesFromMemory:
    """Mixed into the Trainer's class: a resume from ckptless's directory loads nothing from disk."""

    _ckptless_run: _Run

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if resume_from_checkpoint != self._ckptless_run.resume_dir:
            super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        run = self._ckptless_run
        if checkpoint != run.resume_dir:
            super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
            return
        if run.scheduler.pending is not None and self.lr_scheduler is not None:  # type: ignore[attr-defined]
            self.lr_scheduler.load_state_dict(run.scheduler.pending)  # type: ignore[attr-defined]
        # Making the new scheduler set the optimizer's LR (to its first step's): the restored groups' values
        # (as loading the optimizer after the scheduler does for a checkpoint on disk).
        for group, saved in zip(self.optimizer.param_groups, run.groups):  # type: ignore[attr-defined]
            group.update(saved)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint != self._ckptless_run.resume_dir:
            super()._load_rng_state(checkpoint)  # type: ignore[misc]
        # ours: put back at the first step (step_begins), after every draw the skipping made


class _Run:
    def __init__(self, job: Job, trainer: Trainer) -> None:
        self.job, self.trainer = job, trainer
        self.scheduler, self.state = _Scheduler(trainer), _State(trainer)
        self.resume_dir = tempfile.mkdtemp(prefix="ckptless-hf-")
        self._rng: dict[str, Any] | None = None  # the resume version's streams, put back at its first step
        self.groups: list[dict[str, Any]] = []  # the restored optimizer's hyperparameters (LR, ...) per group

    def call(self, **train_kwargs: Any) -> Any:
        """One call of ``trainer.train()``: from the start, or resumed at the restored state's step."""
        t = self.trainer
        resume = None
        if t.state.global_step > 0:
            self.groups = [{k: v for k, v in g.items() if k != "params"} for g in t.optimizer.param_groups]  # type: ignore[union-attr]
            with open(os.path.join(self.resume_dir, "trainer_state.json"), "w") as f:
                json.dump(dataclasses.asdict(t.state), f, sort_keys=True)  # what TrainerState.save_to_json writes
            resume = self.resume_dir
        self._rng = RNGState().state_dict()
        eval_on_start = t.args.eval_on_start
        if resume is not None:
            t.args.eval_on_start = False  # the resumed run evaluated at its start already
        try:
            return t.train(resume_from_checkpoint=resume, **train_kwargs)
        finally:
            t.args.eval_on_start = eval_on_start

    def step_begins(self) -> None:
        if self._rng is not None:  # the first step of this call: the streams as the resume version had them
            RNGState().load_state_dict(self._rng)
            self._rng = None
        self.job.begin_step()

    def close(self) -> None:
        shutil.rmtree(self.resume_dir, ignore_errors=True)


def train(trainer: Trainer, **train_kwargs: Any) -> Any:
    """``trainer.train(**train_kwargs)``, protected and recovered; returns what it returns."""
    if not isinstance(trainer, Trainer):
        raise ConfigError("trainer", type(trainer).__name__, "must be a transformers.Trainer")
    for field in ("resume_from_checkpoint", "trial"):
        if field in train_kwargs:
            raise ConfigError(field, train_kwargs[field], "ckptless resumes the Trainer itself: leave it out")
    args = trainer.args
    if args.auto_find_batch_size or trainer.model_init is not None or trainer.is_deepspeed_enabled \
            or trainer.is_fsdp_enabled:
        raise ConfigError("trainer", type(trainer).__name__, "auto_find_batch_size, model_init, DeepSpeed and FSDP "
                                                             "through the Trainer are not supported by ckptless")
    job = current()
    run = _Run(job, trainer)
    if job.world_size > 1 and trainer.model_wrapped is trainer.model:
        # Wrapped here, not inside train(), and by the Trainer's own Accelerator (its DDP arguments, its
        # mixed-precision forward): the reducer's state is protected with it, and the Trainer keeps a
        # wrapper it finds across its train() calls instead of making a new one each time.
        handler = trainer.accelerator.ddp_handler
        if handler is not None and handler.find_unused_parameters:
            if trainer.args.ddp_find_unused_parameters:  # the user's own choice: ckptless cannot restore it
                raise ConfigError("ddp_find_unused_parameters", True, "a DDP reducer with find_unused_parameters "
                                  "rebuilds its buckets per step and cannot be restored exactly; leave it unset")
            # The Trainer's default for a PreTrainedModel (True, to be safe with unused parameters): off, as
            # ckptless restores only that reducer. A model with unused parameters then fails at its second
            # step with DDP's own error naming them (set ddp_find_unused_parameters=False to see it first).
            handler.find_unused_parameters = False
        trainer.model_wrapped = trainer.accelerator.prepare_model(trainer.model)
        if not isinstance(trainer.model_wrapped, DDP):
            raise ConfigError("trainer", type(trainer.model_wrapped).__name__, "the Trainer's Accelerator did not "
                              "wrap the model in DistributedDataParallel (ckptless protects DDP jobs through it)")
    if trainer.args.torch_compile:
        raise ConfigError("torch_compile", True, "not supported by ckptless.integrations.hf yet")
    trainer.create_optimizer()  # the Trainer makes it inside train() otherwise: too late to protect
    trainer.add_callback(_Boundary(run))
    cls = type(trainer)
    trainer.__class__ = type(f"Ckptless{cls.__name__}", (_ResumesFromMemory, cls), {})
    trainer._ckptless_run = run
    job.protect(model=trainer.model_wrapped, optimizer=trainer.optimizer, scheduler=run.scheduler,
                trainer_state=run.state)
    try:
        return job.train(run.call, **train_kwargs)
    finally:
        run.close()
