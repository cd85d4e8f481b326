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

from ckptless.simulate.model import Result, SystemResult, expected, simulate
from ckptless.simulate.params import Params

__all__ = ["Params", "Result", "SystemResult", "expected", "simulate"]
