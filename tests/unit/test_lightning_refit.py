"""A survivor's next ``fit()`` on the Trainer its failed call left, in one process (issue 38).

The integration's own machinery (``_Run``, its three protected parts, ``_Boundary``, the memory
``CheckpointIO``) with a stand-in for the job: each step's start captures the parts and the RNG streams,
as ckptless does; a failure rolls the parts back to an earlier version and calls ``fit()`` again on the
same Trainer. It must end where an uninterrupted run ends, bitwise: after a rollback to an epoch's last
batch (the survivors' ``fit()`` ended at once: "max_epochs reached"), and to right after a validation
inside an epoch with the checkpoint callback on (its files saved again under the same names). The 4-rank
kills (collectives, the DDP reducer's layout): tests/e2e/test_lightning_e2e.py.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from ckptless.integrations import lightning as cl  # noqa: E402
from ckptless.loop import Rewind  # noqa: E402
from ckptless.state.digest import object_digest  # noqa: E402
from ckptless.state.rng import RNGState  # noqa: E402

from ..harness.repo import REPO  # noqa: E402

import importlib.util  # noqa: E402

_spec = importlib.util.spec_from_file_location("lightning_transformer", REPO / "examples" / "lightning_transformer.py")
assert _spec is not None and _spec.loader is not None
ex = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ex)


class _Job:
    """Stands in for ckptless's job: captures at each step's start; rolls back once, from ``fail_at`` to ``back_to``."""

    world_size = 1

    def __init__(self, fail_at: int | None, back_to: int) -> None:
        self.fail_at, self.back_to, self.step = fail_at, back_to, -1
        self.parts: dict[str, Any] = {}
        self.images: dict[int, dict[str, Any]] = {}

    def begin_step(self) -> None:
        self.step += 1
        self.images[self.step] = copy.deepcopy({**{n: p.state_dict() for n, p in self.parts.items()},
                                                "rng": RNGState().state_dict()})
        if self.step == self.fail_at:
            self.fail_at = None
            image = copy.deepcopy(self.images[self.back_to])
            RNGState().load_state_dict(image.pop("rng"))
            for name, sd in image.items():
                self.parts[name].load_state_dict(sd)
            self.step = self.back_to - 1
            raise Rewind


def _train(tmp: Path, fail_at: int | None, back_to: int = 0) -> tuple[dict[str, torch.Tensor], list[str], int, str]:
    """Trains in ``tmp`` (the working directory: paths in the state are relative to it)."""
    tmp.mkdir(parents=True)
    os.chdir(tmp)
    pl.seed_everything(0)
    torch.manual_seed(0)
    train, val = ex.tokens(72, 0), ex.tokens(16, 1)
    loader = torch.utils.data.DataLoader(train, batch_size=8, shuffle=False)
    val_loader = torch.utils.data.DataLoader(val, batch_size=8)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, val_check_interval=0.5, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    model = ex.TinyTransformer(lr=3e-3)
    job = _Job(fail_at, back_to)
    run = cl._Run(job, trainer, model, cl.ResumableLoader(loader))  # type: ignore[arg-type]
    trainer.strategy.checkpoint_io = cl._MemoryCheckpointIO(trainer.strategy.checkpoint_io, run)
    trainer.callbacks.append(cl._Boundary(run))
    job.parts = {name: cl._LightningState(run, name) for name in cl._LightningState.PARTS}
    calls = 0
    while True:
        calls += 1
        try:
            run.call(model, {"train_dataloaders": run.loader, "val_dataloaders": val_loader})
            break
        except Rewind:
            continue
    files = sorted(p.name for p in (tmp / "checkpoints").iterdir())
    rest = object_digest(cl._LightningState(run, "lightning").state_dict())  # loops, callbacks, schedulers
    return {k: v.clone() for k, v in model.state_dict().items()}, files, calls, rest


@pytest.mark.parametrize("fail_at, back_to", [(10, 8), (6, 4), (14, 13)],
                         ids=["to an epoch's last batch", "to right after a mid-epoch validation", "mid-epoch"])
def test_a_survivors_second_fit_ends_bitwise_where_the_uninterrupted_run_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: int, back_to: int) -> None:
    # 9 batches an epoch, validation after batches 4 and 8 (0-based 3 and 7) and at the epoch's end
    monkeypatch.chdir(tmp_path)
    want, want_files, _, want_rest = _train(tmp_path / "clean", None)
    got, files, calls, rest = _train(tmp_path / "rolled", fail_at, back_to)
    assert calls == 2
    assert files == want_files, "a checkpoint file saved again got another name"
    assert rest == want_rest, "Lightning's loops/callbacks state differs (e.g. _batches_that_stepped)"
    for k in want:
        assert torch.equal(want[k], got[k]), k
