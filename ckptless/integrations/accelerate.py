"""Hugging Face Accelerate (1.x) custom loops under ckptless: the Accelerator's own state, protected.

    job = ckptless.init()                                  # before the Accelerator: it makes the process group
    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    job.protect(model=model, optimizer=optimizer, scheduler=scheduler)
    job.train(ckptless.integrations.accelerate.loop(accelerator, train), epochs)   # instead of train(epochs)
    job.close()

Inside ``train`` the loop stays Accelerate's (``with accelerator.accumulate(model):``,
``accelerator.backward(loss)``, the prepared optimizer's and scheduler's ``step``), with
``ckptless.epochs(...)`` around the epoch loop and ``ckptless.batches(train_dl)`` around each pass,
as for any loop run by ``job.train`` (docs/porting.md, "Your own loop").

Why a wrapper: an Accelerate loop carries state that is neither the model's, the optimizer's nor
the scheduler's, and that the script never names:

* ``accelerator.step``, the gradient-accumulation counter ``accumulate()`` counts micro-batches
  with (an optimizer step where ``step % gradient_accumulation_steps == 0``), and
  ``GradientState.sync_gradients``, which the prepared optimizer, scheduler and ``zero_grad`` read;
* each prepared loader's ``iteration`` (Accelerate's epoch counter: its ``__iter__`` calls
  ``set_epoch(iteration)`` on the sampler; a seedable sampler's order depends on it) and a
  ``SeedableRandomSampler``'s own ``epoch``.

:func:`loop` protects them as one object (``accelerate``) and returns the function to give to
``job.train``; each call of it (the first, and again after a recovery) first drops the loaders
``GradientState`` still lists as active: a pass left by a recovery never ran the loader's ``end()``.

The rest needs nothing from the script: a prepared loader's pass is reopened below its adapter
(:func:`ckptless.passes.open_pass`: the inner ``DataLoader``'s index stream replayed, the
synchronized generator put back and broadcast as Accelerate does at a pass's start), the RNG streams
are protected as for any job, and a prepared ``AcceleratedOptimizer``'s step pre-hook is placed on the
optimizer it wraps (:mod:`ckptless.state.fence`), so the capture overlaps the step.

A failure inside a gradient-accumulation window resumes at the window's start and runs its
micro-batches again (:mod:`ckptless.state.window`: a version taken while the optimizer the
``AcceleratedOptimizer`` wraps holds gradients it has not stepped on is not protected).

Not covered: DeepSpeed, FSDP and Megatron through Accelerate, a ``GradScaler`` (``mixed_precision="fp16"``),
``dispatch_batches=True`` with map-style data is reopened by fetching the trained batches again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ckptless.errors import ConfigError
from ckptless.job import current

try:
    from accelerate import Accelerator
    from accelerate.data_loader import SeedableRandomSampler
except ImportError as exc:  # pragma: no cover - the extra is not installed
    raise ImportError("ckptless.integrations.accelerate needs accelerate: pip install 'ckptless[hf]'") from exc

__all__ = ["AcceleratorState", "loop"]

ENTRY = "accelerate"
"""The name the Accelerator's state is protected under."""


class AcceleratorState:
    """The Accelerator's loop state (module doc) as a Stateful: a few ints and a bool, no tensor."""

    __ckptless_data_position__ = False  # the loop's position is job.train's; this only completes it

    def __init__(self, accelerator: Accelerator) -> None:
        self.accelerator = accelerator

    def _samplers(self) -> list[SeedableRandomSampler]:
        out: list[SeedableRandomSampler] = []
        for dl in self.accelerator._dataloaders:
            for obj in (getattr(dl, "sampler", None), getattr(getattr(dl, "batch_sampler", None), "sampler", None),
                        getattr(getattr(getattr(dl, "batch_sampler", None), "batch_sampler", None), "sampler", None)):
                if isinstance(obj, SeedableRandomSampler) and all(obj is not s for s in out):
                    out.append(obj)
        return out

    def state_dict(self) -> dict[str, Any]:
        acc = self.accelerator
        return {"step": int(acc.step), "sync_gradients": bool(acc.gradient_state.sync_gradients),
                "iterations": [int(getattr(dl, "iteration", 0)) for dl in acc._dataloaders],
                "sampler_epochs": [int(s.epoch) for s in self._samplers()]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        acc = self.accelerator
        loaders, samplers = acc._dataloaders, self._samplers()
        if len(sd["iterations"]) != len(loaders) or len(sd["sampler_epochs"]) != len(samplers):
            raise ConfigError("accelerator", f"{len(loaders)} prepared loader(s)",
                              f"the image holds {len(sd['iterations'])}: prepare the same loaders in every process")
        acc.step = int(sd["step"])
        acc.gradient_state._set_sync_gradients(bool(sd["sync_gradients"]))
        for dl, iteration in zip(loaders, sd["iterations"]):
            if hasattr(dl, "iteration"):
                dl.iteration = int(iteration)
        for s, epoch in zip(samplers, sd["sampler_epochs"]):
            s.set_epoch(int(epoch))


def loop(accelerator: Accelerator, fn: Callable[..., Any]) -> Callable[..., Any]:
    """Protect ``accelerator``'s own state (module doc); return ``fn`` as ``job.train`` should call it."""
    if not isinstance(accelerator, Accelerator):
        raise ConfigError("accelerator", type(accelerator).__name__, "must be an accelerate.Accelerator")
    if accelerator.distributed_type.value not in ("NO", "MULTI_CPU", "MULTI_GPU"):
        raise ConfigError("accelerator", accelerator.distributed_type.value,
                          "ckptless protects Accelerate's DDP (MULTI_CPU/MULTI_GPU) jobs; DeepSpeed, FSDP, "
                          "Megatron and XLA through Accelerate are not supported")
    if accelerator.scaler is not None:
        raise ConfigError("mixed_precision", "fp16", "a GradScaler through Accelerate is not supported by "
                                                     "ckptless yet: use bf16 or fp32")
    current().protect(**{ENTRY: AcceleratorState(accelerator)})

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        # A pass left by a recovery (ckptless.loop.Rewind, or a fault) closed the adapter's generator
        # before its end(): GradientState would still count that pass as the active loader.
        accelerator.gradient_state.dataloader_references = [None]
        return fn(*args, **kwargs)

    return call
