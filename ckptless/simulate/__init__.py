"""``ckptless simulate``: a discrete-event model of a training job's goodput under failures.

One module per concept: :mod:`~ckptless.simulate.params` (the job, validated),
:mod:`~ckptless.simulate.presets` (published jobs and where their numbers come from),
:mod:`~ckptless.simulate.failures` (the seeded failure process), :mod:`~ckptless.simulate.costs`
(what each recovery phase costs and how it grows with W), :mod:`~ckptless.simulate.placement`
(when a failure set defeats the mirrors: exact, closed form, checked),
:mod:`~ckptless.simulate.engine` (the simulated clock and the seconds' ledger),
:mod:`~ckptless.simulate.policies` (ckptless, restart-from-disk, TorchFT-style),
:mod:`~ckptless.simulate.model` (``simulate(params, seed) -> Result``),
:mod:`~ckptless.simulate.recommend` (a small search over K, spares, mirror_every, snapshots),
:mod:`~ckptless.simulate.report` (text and JSON). docs/goodput.md explains the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptless import lazy
from ckptless.simulate.model import Result, SystemResult, expected, simulate
from ckptless.simulate.params import Params

__all__ = ["Params", "Result", "SystemResult", "expected", "simulate",
           "add_arguments", "params_from", "build", "render", "to_json"]


# Imported on first use (ckptless/lazy.py): an importer of one module pays for no other.
if TYPE_CHECKING:
    from ckptless.simulate.cli import add_arguments, params_from
    from ckptless.simulate.report import build, render, to_json

__getattr__ = lazy.exports(__name__, {
    "cli": "add_arguments params_from",
    "report": "build render to_json",
})
