"""The Lightning integration's pure parts (issue 38): what a survivor's next ``fit()`` starts from, the
epoch's last batch, paths under the working directory. The 4-rank kills: tests/e2e/test_lightning_e2e.py."""

from __future__ import annotations

import os

import pytest

pl = pytest.importorskip("lightning.pytorch")

from ckptless.integrations import lightning as cl  # noqa: E402


def test_a_survivors_trainer_is_put_back_to_what_a_replacements_starts_from() -> None:
    """State in no checkpoint that Lightning branches on to run collectives (a save: barrier + broadcasts)."""
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False)
    fresh = cl._Fresh(trainer)
    ckpt = trainer.checkpoint_callback
    assert ckpt is not None
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    ckpt._last_global_step_saved, ckpt.dirpath, trainer.should_stop = 9, "/tmp/x", True
    val_loop._has_run = True  # set by a validation; not there on a new Trainer's loop
    trainer.fit_loop.epoch_progress.current.processed = 3
    had_run = "_has_run" in vars(pl.Trainer(accelerator="cpu", logger=False).fit_loop.epoch_loop.val_loop)
    fresh.restore()
    assert ckpt._last_global_step_saved == 0 and ckpt.dirpath is None and trainer.should_stop is False
    assert trainer.fit_loop.epoch_progress.current.processed == 0
    assert ("_has_run" in vars(val_loop)) == had_run and (not had_run or val_loop._has_run is False)
    assert trainer.checkpoint_callback is ckpt and trainer.fit_loop.epoch_loop.val_loop is val_loop  # objects kept


def test_a_capture_at_an_epochs_last_batch_is_not_last() -> None:
    """The fetch of batch 8 of 9 set is_last_batch; resumed from there Lightning ended the epoch at once."""
    progress = {"total": {"ready": 9, "started": 8, "processed": 8, "completed": 8},
                "current": {"ready": 9, "started": 8, "processed": 8, "completed": 8}, "is_last_batch": True}
    ckpt = {"loops": {"fit_loop": {"epoch_loop.batch_progress": progress}}}
    cl._settle_batch_progress(ckpt)
    assert progress["total"]["ready"] == progress["current"]["ready"] == 8 and progress["is_last_batch"] is False


def test_paths_under_the_working_directory_travel_relative(tmp_path: os.PathLike[str]) -> None:
    cwd = str(tmp_path)
    ckpt = {"callbacks": {"ModelCheckpoint{}": {"dirpath": os.path.join(cwd, "checkpoints"),
                                                "best_k_models": {os.path.join(cwd, "a.ckpt"): 1.0},
                                                "other": "/elsewhere/b.ckpt", "same": cwd + "x"}}, "t": (1, 2)}
    out = cl._paths_out(ckpt, cwd)
    inner = out["callbacks"]["ModelCheckpoint{}"]
    assert inner["dirpath"] == cl.CWD + "/checkpoints" and cl.CWD + "/a.ckpt" in inner["best_k_models"]
    assert inner["other"] == "/elsewhere/b.ckpt" and inner["same"] == cwd + "x" and out["t"] == [1, 2]
    back = cl._paths_in(out, "/another/run")
    assert back["callbacks"]["ModelCheckpoint{}"]["dirpath"] == "/another/run/checkpoints"
