"""Hugging Face Accelerate's prepared loaders and optimizer under ckptless, in one process.

* A prepared loader (``DataLoaderShard``: a ``BatchSamplerShard`` over a shuffling sampler whose
  generator Accelerate synchronizes at each pass) is reopened exactly after any rollbacks, by the same
  stand-in machine as tests/unit/test_loop.py: the batches trained and every RNG stream end equal to
  the run without rollbacks. Before the fix its first batch raised ``AttributeError: 'DataLoader'
  object has no attribute 'dl_state_dict'`` (the adapter passed for a stateful loader).
* A prepared ``AcceleratedOptimizer`` gets the capture's step pre-hook on the optimizer it wraps (it
  never ran ``Optimizer.__init__``): the capture keeps overlapping the step, no warning.
* The Accelerator's own state (its accumulation counter, ``GradientState.sync_gradients``, a
  loader's epoch counter) round-trips through :class:`ckptless.integrations.accelerate.AcceleratorState`.

The same with real processes, etcd and SIGKILLs: tests/e2e/test_integrations_e2e.py.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.data_loader import prepare_data_loader  # noqa: E402
from accelerate.state import GradientState  # noqa: E402

from ckptless.errors import ConfigError  # noqa: E402
from ckptless.integrations.accelerate import AcceleratorState, loop  # noqa: E402
from ckptless.passes import adapted, is_stateful  # noqa: E402
from ckptless.state.fence import PROBE_CAPTURES, CopyFence, WriteOrder, hookable  # noqa: E402

from .test_loop import Augmented, Jittered, Squares, _rollback_plans, epoch_loop, run_loop  # noqa: E402


@pytest.fixture(scope="module")
def accelerator() -> Accelerator:
    return Accelerator(cpu=True, gradient_accumulation_steps=2)  # one process: DistributedType.NO


def _prepared(dataset: Any, seedable: bool = False, **kwargs: Any) -> Any:
    """Rank 1's loader of 2 (a BatchSamplerShard), as Accelerate prepares it (no broadcast in one process)."""
    return prepare_data_loader(DataLoader(dataset, batch_size=3, shuffle=True, **kwargs), num_processes=2,
                               process_index=1,
                               put_on_device=False, rng_types=["generator"], use_seedable_sampler=seedable,
                               data_seed=5 if seedable else None)


KINDS = {"shard": lambda: _prepared(Squares(23)), "seedable": lambda: _prepared(Squares(23), seedable=True)}


def _state(loader: Any) -> dict[str, Any]:
    """The loader's epoch counter protected as the integration protects it (an Accelerator's stand-in)."""
    return {"accelerate": AcceleratorState(SimpleNamespace(  # type: ignore[arg-type]
        _dataloaders=[loader], step=0, gradient_state=GradientState()))}


def test_a_prepared_loader_is_reopened_below_its_adapter(accelerator: Accelerator) -> None:
    loader = KINDS["shard"]()
    assert type(loader).__name__ == "DataLoaderShard" and isinstance(loader, DataLoader)  # (its __class__)
    assert adapted(loader) is loader.base_dataloader and not is_stateful(loader)
    assert loader.synchronized_generator is not None


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(sorted(KINDS)), epochs=st.integers(1, 3), data=st.data())
def test_a_prepared_loader_resumes_exactly_after_any_rollbacks(accelerator: Accelerator, kind: str, epochs: int,
                                                               data: st.DataObject) -> None:
    baseline = run_loop(KINDS[kind], epoch_loop, epochs, {}, extra=_state)
    # The sampler's generator is the script's (made at prepare): a pass restores it from what it recorded
    # when it opened, so only version 0 (no pass opened yet) finds it where a survivor left it.
    plan = data.draw(_rollback_plans(len(baseline.record), first=1), label="rollbacks")
    got = run_loop(KINDS[kind], epoch_loop, epochs, plan, extra=_state)
    assert got.same(baseline)
    assert got.calls == 1 + len(plan)


def test_a_random_transform_loaded_in_process_is_not_reproduced_under_the_look_ahead(
        accelerator: Accelerator) -> None:
    """A known limit (docs/state.md): the adapter loads batch k+1 while batch k is handed out, so a
    transform drawn from the global streams in ``__getitem__`` with ``num_workers=0`` is drawn from
    other states when the pass is reopened (loader workers are seeded per sample instead)."""
    baseline = run_loop(lambda: _prepared(Jittered(23)), epoch_loop, 1, {}, extra=_state)
    got = run_loop(lambda: _prepared(Jittered(23)), epoch_loop, 1, {2: 2}, extra=_state)
    assert got.record[:2] == baseline.record[:2] and got.record != baseline.record


@pytest.mark.parametrize("persistent", [False, True])
def test_a_prepared_loaders_workers_draw_the_same_transforms_after_rollbacks(accelerator: Accelerator,
                                                                            persistent: bool) -> None:
    """Two workers drawing a random transform per sample (issue 38: an Accelerate port with
    ``num_workers=2`` ended with every object differing): seeded per sample through the inner loader."""
    def make() -> Any:
        return _prepared(Augmented(24), num_workers=2, persistent_workers=persistent)

    baseline = run_loop(make, epoch_loop, 2, {}, extra=_state)
    got = run_loop(make, epoch_loop, 2, {6: 3, 7: 5}, extra=_state)
    assert got.same(baseline) and got.calls == 3


def test_an_accelerated_optimizer_is_hooked_through_the_optimizer_it_wraps(
        accelerator: Accelerator, caplog: pytest.LogCaptureFixture) -> None:
    model = torch.nn.Linear(3, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, inner)
    assert "_optimizer_step_pre_hooks" not in vars(opt)  # the wrapper never ran Optimizer.__init__
    assert hookable(opt)[0] is inner
    order = WriteOrder()
    with caplog.at_level(logging.WARNING):
        order.install([model, opt, inner])  # the wrapper and what it wraps: one hook
    assert not caplog.records and not order.conservative and order.optimizers == [inner]
    order.clean_probes = PROBE_CAPTURES
    assert order.overlapping

    class Marker:
        ordered = 0

        def done(self) -> bool:
            return True

        def order_current(self) -> None:
            self.ordered += 1

    late = Marker()
    order.captured(CopyFence([], [late], [(0, model.weight, model.weight._version)]))
    order.before_step()
    assert late.ordered == 0  # the forward and backward overlap the copy
    gs = accelerator.gradient_state
    gs._set_sync_gradients(False)  # an accumulation micro-batch: the wrapper does not step
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    assert late.ordered == 0
    gs._set_sync_gradients(True)
    opt.step()  # the real step: its pre-hook orders the copy before the first write
    assert late.ordered == 1


def test_a_wrapper_with_nothing_hookable_inside_still_turns_conservative() -> None:
    class Bare(torch.optim.Optimizer):
        def __init__(self, inner: Any) -> None:  # never runs Optimizer.__init__
            self.optimizer = inner

    assert hookable(Bare(None))[0] is None
    order = WriteOrder()
    order.install([Bare(Bare(None))])
    assert order.conservative


def test_the_accelerators_own_state_round_trips(accelerator: Accelerator) -> None:
    loader = accelerator.prepare(DataLoader(Squares(12), batch_size=3, shuffle=True))
    state = AcceleratorState(accelerator)
    accelerator.step, loader.iteration = 3, 2
    accelerator.gradient_state._set_sync_gradients(False)
    saved = state.state_dict()
    accelerator.step, loader.iteration = 0, 5
    accelerator.gradient_state._set_sync_gradients(True)
    state.load_state_dict(saved)
    assert (accelerator.step, loader.iteration, accelerator.sync_gradients) == (3, 2, False)
    with pytest.raises(ConfigError, match="prepared loader"):
        state.load_state_dict({**saved, "iterations": []})
    with pytest.raises(ConfigError, match="accelerate.Accelerator"):
        loop(object(), lambda: None)  # type: ignore[arg-type]
