"""The asynchronous capture's fence (ckptless/state/fence.py), with stand-in markers.

What must hold, whatever the script does: a step never overwrites a tensor whose copy is still in
flight unless that is detected (the image is then called torn and never mirrored), early tensors
are ordered at the start of the next step, late ones (parameters, optimizer state) at the
optimizer's step, and a torn image switches the process to ordering everything at the step start.
The CUDA events behind the markers run in ``make test-gpu``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ckptless.errors import DeviceTimeout, StateError
from ckptless.state import devices, host_memory, streams
from ckptless.state.fence import PROBE_CAPTURES, CopyFence, WriteOrder, late_sources
from ckptless.state.rng import RNGState


class FakeMarker:
    """A point in a device's work: ``finished`` says whether the GPU got there; ``ordered`` counts
    how often a compute stream was made to wait for it."""

    def __init__(self, finished: bool = False) -> None:
        self.finished = finished
        self.ordered = 0

    def done(self) -> bool:
        return self.finished

    def order_current(self) -> None:
        self.ordered += 1


def _fence(watched: list[torch.Tensor], finished: bool = False) -> tuple[CopyFence, FakeMarker, FakeMarker]:
    early, late = FakeMarker(finished), FakeMarker(finished)
    return CopyFence([early], [late], [(i, t, t._version) for i, t in enumerate(watched)]), early, late


def _overlapping(objects: list[object]) -> WriteOrder:
    """A write order past its probe: late copies overlap the next step (what the steady state does)."""
    order = WriteOrder()
    order.install(objects)
    order.clean_probes = PROBE_CAPTURES
    assert order.overlapping
    return order


def _model_and_opt() -> tuple[nn.Linear, torch.optim.SGD]:
    m = nn.Linear(3, 2)
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


def _step(m: nn.Linear, opt: torch.optim.SGD) -> None:
    opt.zero_grad()
    m(torch.ones(1, 3)).sum().backward()
    opt.step()


def test_early_copies_are_ordered_at_the_step_start_late_ones_at_the_optimizer_step() -> None:
    m, opt = _model_and_opt()
    order = _overlapping([m, opt])
    fence, early, late = _fence([m.weight, m.bias])
    order.captured(fence)
    order.before_step()
    assert (early.ordered, late.ordered) == (1, 0)  # the forward pass overlaps the late copies
    m(torch.ones(1, 3)).sum().backward()
    assert late.ordered == 0
    opt.step()  # the pre-hook orders every copy before the first write
    assert late.ordered == 1 and early.ordered == 2
    _step(m, opt)  # idempotent: once per fence
    assert late.ordered == 1
    late.finished = early.finished = True
    assert fence.seal() is None and fence.torn is None and not order.conservative


def test_without_a_protected_optimizer_everything_is_ordered_at_the_step_start() -> None:
    m, _ = _model_and_opt()
    order = WriteOrder()
    order.install([m])
    order.clean_probes = PROBE_CAPTURES
    assert not order.overlapping
    fence, early, late = _fence([m.weight])
    order.captured(fence)
    order.before_step()
    assert early.ordered >= 1 and late.ordered == 1


def test_a_write_before_the_optimizer_step_tears_the_image_and_turns_conservative() -> None:
    m, opt = _model_and_opt()
    order = _overlapping([m, opt])
    fence, _, late = _fence([m.weight, m.bias])
    order.captured(fence)
    order.before_step()
    with torch.no_grad():
        m.weight.clamp_(-0.1, 0.1)  # the script writes a parameter in place before its optimizer step
    opt.step()
    assert fence.torn is not None and "#0" in fence.torn and "before the optimizer step" in fence.torn
    assert order.conservative
    late.finished = True
    assert fence.seal() == fence.torn  # the mirror engine refuses it (tests/unit/test_fence.py::engine)
    nxt, _, late2 = _fence([m.weight])
    order.captured(nxt)
    order.before_step()
    assert late2.ordered == 1  # conservative: the late copies are ordered at the step start now


def test_a_copy_done_before_any_write_is_sealed_clean_and_needs_no_ordering() -> None:
    m, opt = _model_and_opt()
    order = _overlapping([m, opt])
    fence, early, late = _fence([m.weight], finished=True)
    order.captured(fence)
    assert fence.seal() is None  # the mirror thread saw it done first
    order.before_step()
    _step(m, opt)  # a write after the seal is harmless
    assert (early.ordered, late.ordered) == (0, 0) and fence.torn is None


def test_a_write_the_mirror_thread_sees_before_any_ordering_tears_the_image() -> None:
    m, _ = _model_and_opt()
    fence, _, _ = _fence([m.weight], finished=True)
    with torch.no_grad():
        m.weight.add_(1)
    assert fence.seal() is not None


def test_a_new_capture_orders_the_previous_one_and_drain_waits_for_it() -> None:
    m, opt = _model_and_opt()
    order = _overlapping([m, opt])
    first, _, late1 = _fence([m.weight])
    order.captured(first)
    second, _, late2 = _fence([m.weight])
    order.captured(second)  # no optimizer step in between (gradient accumulation): ordered now
    assert late1.ordered == 1 and late2.ordered == 0
    late2.finished = True
    second.early[0].finished = True  # type: ignore[attr-defined]
    order.drain(1.0)
    assert late2.ordered == 1
    order.before_step()  # nothing pending any more


def test_a_copy_that_never_finishes_is_a_device_timeout_not_a_hang() -> None:
    fence, _, _ = _fence([])
    with pytest.raises(DeviceTimeout, match="did not finish within"):
        fence.wait(0.05, "a capture")


def test_install_again_replaces_the_hooks() -> None:
    m, opt = _model_and_opt()
    order = WriteOrder()
    order.install([m, opt])
    order.install([m, opt])
    fence, _, late = _fence([m.weight])
    order.captured(fence)
    opt.step()
    assert late.ordered == 1
    order.install([m])
    assert not order.overlapping and not opt._optimizer_step_pre_hooks


def test_late_sources_are_parameters_and_optimizer_state_never_buffers() -> None:
    bn = nn.BatchNorm1d(3)
    opt = torch.optim.Adam(bn.parameters())
    bn(torch.randn(4, 3)).sum().backward()
    opt.step()
    late = late_sources([bn, opt])
    moments = [v for st in opt.state.values() for v in st.values() if v.numel()]
    assert set(late) == {bn.weight.data_ptr(), bn.bias.data_ptr(), *(v.data_ptr() for v in moments)}
    assert bn.running_mean.data_ptr() not in late  # a forward pass writes it: early, ordered at the step start


def test_the_probe_orders_at_the_step_start_and_finds_a_script_that_writes_outside_its_step() -> None:
    m, opt = _model_and_opt()
    order = WriteOrder()
    order.install([m, opt])
    fence, _, late = _fence([m.weight, m.bias])
    order.captured(fence)
    order.before_step()
    assert late.ordered == 1  # probing: nothing overlaps yet, so nothing can race
    with torch.no_grad():
        m.weight.clamp_(-0.1, 0.1)
    opt.step()
    assert order.conservative and fence.torn is None  # found while nothing could tear


def test_the_probe_lets_a_clean_script_overlap_after_its_probe_captures() -> None:
    m, opt = _model_and_opt()
    order = WriteOrder()
    order.install([m, opt])
    for i in range(PROBE_CAPTURES + 1):
        fence, _, late = _fence([m.weight, m.bias])
        order.captured(fence)
        order.before_step()
        assert late.ordered == (1 if i < PROBE_CAPTURES else 0), i
        _step(m, opt)
    assert order.overlapping and not order.conservative


def test_capture_order_step_orders_everything_at_the_step_start_forever() -> None:
    m, opt = _model_and_opt()
    order = WriteOrder(always_at_start=True)
    order.install([m, opt])
    order.clean_probes = PROBE_CAPTURES
    fence, _, late = _fence([m.weight])
    order.captured(fence)
    order.before_step()
    assert late.ordered == 1 and not order.overlapping


def test_an_optimizer_without_step_hooks_turns_the_order_conservative() -> None:
    class Bare(torch.optim.Optimizer):
        def __init__(self) -> None:  # never runs Optimizer.__init__ (some wrappers do this)
            self.param_groups = []

    order = WriteOrder()
    order.install([Bare()])
    assert order.conservative


def test_a_dtensor_write_is_seen_on_the_dtensors_counter_not_its_shards() -> None:
    """FSDP2 parameters are DTensors: an in-place write bumps the DTensor's counter only."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        p = nn.Parameter(distribute_tensor(torch.randn(4, 2), mesh, [Shard(0)]))
        late = late_sources([nn.ParameterList([p])])
        shard = p.to_local()
        watch = late[shard.data_ptr()]
        assert watch is p
        fence = CopyFence([FakeMarker(True)], [FakeMarker(True)], [(0, watch, watch._version)])
        with torch.no_grad():
            p.add_(1)
        assert fence.seal() is not None
    finally:
        dist.destroy_process_group()


# --- device-relative images and host memory, on a machine without CUDA -----------------------------


def test_images_record_a_device_type_and_legacy_indices_mean_the_type() -> None:
    assert devices.parse("cuda:3") == torch.device("cuda") and devices.parse("cuda") == torch.device("cuda")
    assert devices.parse("cuda:3").type == torch.device("cuda", 5).type  # any GPU of the rank's takes it
    assert devices.target("cpu") == torch.device("cpu")
    with pytest.raises(StateError, match="invalid device"):
        devices.parse("warp-drive:9")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only behaviour")
def test_without_cuda_a_gpu_image_is_one_clear_error_and_nothing_is_pinned() -> None:
    with pytest.raises(StateError, match="sees no CUDA device"):
        devices.target("cuda")
    buf = host_memory.empty(64)
    assert not host_memory.pinned(buf) and not host_memory.register(buf) and host_memory.registered_bytes() == 0
    host_memory.unregister(buf)  # a no-op
    streams.sync_devices([torch.device("cpu")], 0.1, "nothing")  # CPU devices need no wait


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only behaviour")
def test_rng_of_a_cpu_process_holds_no_cuda_state_and_refuses_a_gpu_ranks() -> None:
    state = RNGState().state_dict()
    assert state["cuda"] == []
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)]  # what a GPU rank's image holds: one generator
    before = torch.get_rng_state()
    with pytest.raises(StateError, match="sees no CUDA device"):
        RNGState().load_state_dict(state)
    assert torch.equal(torch.get_rng_state(), before)  # nothing was touched


# --- per-device streams, the rank's device, its CUDA generator: pure logic with stand-ins --------------
# (the real CUDA calls behind them run in make test-gpu: tests/gpu/scripts/capture_restore.py, rng_device.py)


class OnDevice:
    """Stands for a GPU tensor in the copy plan: it has a device and a data pointer, nothing more."""

    def __init__(self, device: str, ptr: int) -> None:
        self.device = torch.device(device)
        self._ptr = ptr

    def data_ptr(self) -> int:
        return self._ptr


def test_each_source_device_gets_its_own_copies_early_before_late_in_image_order() -> None:
    from ckptless.state.capture import copy_plan

    dst = torch.empty(0)
    pairs = [(0, dst, OnDevice("cuda:1", 10)), (1, dst, OnDevice("cuda:0", 20)), (2, dst, OnDevice("cuda:1", 30)),
             (3, dst, OnDevice("cuda:0", 40)), (4, dst, OnDevice("cuda:1", 50))]
    plan = copy_plan(pairs, late={10, 40})  # type: ignore[arg-type]
    assert set(plan) == {torch.device("cuda", 0), torch.device("cuda", 1)}  # a stream per source device
    early1, late1 = plan[torch.device("cuda", 1)]
    assert [i for i, _, _ in early1] == [2, 4] and [i for i, _, _ in late1] == [0]
    early0, late0 = plan[torch.device("cuda", 0)]
    assert [i for i, _, _ in early0] == [1] and [i for i, _, _ in late0] == [3]


def _index(device: int | torch.device) -> int:
    return device.index if isinstance(device, torch.device) else int(device)  # type: ignore[return-value]


class FakeCuda:
    """torch.cuda's generator calls, for one process that sees ``n`` GPUs with ``current`` current."""

    def __init__(self, n: int, current: int) -> None:
        self.n, self.current = n, current
        self.states = {i: torch.full((16,), i, dtype=torch.uint8) for i in range(n)}

    def install(self, mp: pytest.MonkeyPatch) -> None:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "is_initialized", lambda: True)
        mp.setattr(torch.cuda, "device_count", lambda: self.n)
        mp.setattr(torch.cuda, "current_device", lambda: self.current)
        mp.setattr(torch.cuda, "get_rng_state", lambda device: self.states[_index(device)].clone())
        mp.setattr(torch.cuda, "set_rng_state", lambda state, device: self.states.__setitem__(_index(device), state))
        mp.setattr(torch.cuda, "set_rng_state_all", lambda states: self.states.update(enumerate(states)))


def test_the_rank_saves_its_own_gpus_generator_and_restores_it_on_whatever_gpu_it_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    saver = FakeCuda(n=8, current=3)
    saver.install(monkeypatch)
    state = RNGState().state_dict()
    assert len(state["cuda"]) == 1 and torch.equal(state["cuda"][0], saver.states[3])  # GPU 3's, not all 8
    restorer = FakeCuda(n=2, current=1)  # another node, another index, another count
    restorer.install(monkeypatch)
    before0 = restorer.states[0].clone()
    RNGState().load_state_dict(state)
    assert torch.equal(restorer.states[1], saver.states[3]) and torch.equal(restorer.states[0], before0)


def test_an_older_image_with_one_state_per_gpu_restores_only_where_the_count_matches(
        monkeypatch: pytest.MonkeyPatch) -> None:
    old = FakeCuda(n=4, current=0)
    old.install(monkeypatch)
    state = RNGState().state_dict()
    state["cuda"] = [old.states[i] for i in range(4)]
    FakeCuda(n=2, current=0).install(monkeypatch)
    with pytest.raises(StateError, match="one per device, an older image"):
        RNGState().load_state_dict(state)
    same = FakeCuda(n=4, current=2)
    same.install(monkeypatch)
    RNGState().load_state_dict(state)
    assert all(torch.equal(same.states[i], old.states[i]) for i in range(4))


def test_gpu_tensors_go_to_the_ranks_gpu_when_no_live_tensor_says(monkeypatch: pytest.MonkeyPatch) -> None:
    FakeCuda(n=8, current=5).install(monkeypatch)
    assert devices.target("cuda") == torch.device("cuda", 5)
    assert devices.target("cuda:3") == torch.device("cuda", 5)  # an older image's index is not obeyed
    devices.set_home(torch.device("cuda", 6))  # what init() sets: every thread, whatever its current device
    try:
        assert devices.target("cuda") == torch.device("cuda", 6) and devices.home() == torch.device("cuda", 6)
    finally:
        devices.set_home(None)


def test_an_in_place_restore_matches_device_types_not_indices() -> None:
    from ckptless.state import inplace
    from ckptless.state.manifest import TensorEntry

    live = torch.zeros(2)
    entry = TensorEntry("float32", (2,), 0, 8)
    assert inplace._target(live, 0, (entry,), torch.device("cpu"), "w").live is live
    with pytest.raises(inplace.NoPlan, match="belongs on a cuda device"):
        inplace._target(live, 0, (entry,), devices.parse("cuda:3"), "w")
