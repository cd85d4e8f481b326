"""ckptless: checkpointless peer-to-peer recovery for PyTorch distributed training.

    import ckptless
    job = ckptless.init()                 # inside a ckptless-run worker
    job.protect(model=model, optimizer=opt, scheduler=sched, data=loader)
    job.run(train_step, steps=1000)       # train_step(step) does one step
    # or keep your own loop: job.train(trainer.train), with ckptless.epochs/batches inside it

``init``/``Job`` are imported lazily so that the launcher and the coordinator
(which import ``ckptless.*`` modules) do not pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ckptless import errors

if TYPE_CHECKING:
    from ckptless.job import Job, RunResult, batches, carry, current, epochs, init

__version__ = "0.1.0"
__all__ = ["errors", "init", "Job", "RunResult", "batches", "carry", "current", "epochs", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("init", "Job", "RunResult", "batches", "carry", "current", "epochs"):
        from ckptless import job

        return getattr(job, name)
    raise AttributeError(f"module 'ckptless' has no attribute {name!r}")
