"""In-place restore (issue 9): same bits as the clone path, same tensors, per-object fallback."""

from __future__ import annotations

import copy
import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import TensorDataset

from ckptless.data import ResumableLoader, ResumableSampler
from ckptless.errors import IntegrityError, StateError
from ckptless.state import Capturer, RestoreReport, RNGState, StateImage, StateRegistry, restore
from ckptless.state import inplace

from ..harness.state import assert_log_and_registry_equal, assert_same

# --- models, optimizers, a trainer with every kind of state -----------------------

IN = 75


class ConvBN(nn.Module):
    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3)
        self.bn = nn.BatchNorm2d(width)
        self.head = nn.Linear(width * 9, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.conv(x.view(-1, 3, 5, 5))))
        return self.head(h.flatten(1))


class Tied(nn.Module):
    """One parameter under two state-dict keys, a persistent and a non-persistent buffer."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, width)
        self.enc = nn.Linear(width, width, bias=False)
        self.dec = nn.Linear(width, width)
        self.dec.weight = self.enc.weight
        self.out = nn.Linear(width, 4)
        self.register_buffer("scale", torch.ones(1))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.dec(torch.tanh(self.enc(self.inp(x))))) * self.scale


def mlp(width: int = 16, depth: int = 1) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(IN, width), nn.ReLU(), nn.Dropout(0.3)]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 4))


MODELS: dict[str, Callable[[], nn.Module]] = {"mlp": mlp, "conv_bn": ConvBN, "tied": Tied}


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    ps = list(model.parameters())
    return [{"params": ps[: len(ps) // 2], "lr": 1e-2}, {"params": ps[len(ps) // 2 :], "lr": 5e-3, "betas": (0.8, 0.9)}]


OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.05),
    "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9, nesterov=True),
    "adam_groups_amsgrad": lambda m: torch.optim.Adam(_groups(m), amsgrad=True),
    "rmsprop_centered": lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3, momentum=0.5, centered=True),
    "adagrad": lambda m: torch.optim.Adagrad(m.parameters(), lr=1e-2),
}


class Extras:
    """A user Stateful with nested containers, tensors and scalars (always the clone path)."""

    def __init__(self) -> None:
        self.s: dict[str, Any] = {"ema": {"loss": torch.zeros(1)}, "hist": [torch.zeros(2), (1, 2.5)], "n": 0}

    def state_dict(self) -> dict[str, Any]:
        return self.s

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.s = s

    def update(self, loss: torch.Tensor) -> None:
        self.s["ema"]["loss"].mul_(0.9).add_(loss.detach())
        self.s["hist"][0] += 1
        self.s["n"] += 1


@dataclass
class Trainer:
    model_name: str
    opt_name: str
    init_seed: int = 0
    model: nn.Module | None = None
    log: list[Any] = field(default_factory=list)
    rng: Any = None  # this trainer's global RNG streams while another trainer runs

    def __post_init__(self) -> None:
        torch.manual_seed(self.init_seed)
        random.seed(self.init_seed)
        np.random.seed(self.init_seed)
        if self.model is None:
            self.model = MODELS[self.model_name]()
        self.opt = OPTIMIZERS[self.opt_name](self.model)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.7)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
        self.extras = Extras()
        g = torch.Generator().manual_seed(1234)
        ds = TensorDataset(torch.randn(22, IN, generator=g), torch.randn(22, 4, generator=g))
        self.loader = ResumableLoader(ds, ResumableSampler(len(ds), seed=5), batch_size=4)
        self.registry = StateRegistry()
        self.registry.protect(
            model=self.model, optimizer=self.opt, scheduler=self.sched, scaler=self.scaler,
            data=self.loader, extras=self.extras,
        )
        self.rng = RNGState().state_dict()

    def step(self) -> None:
        assert self.model is not None
        self.model.train()
        x, y = self.loader.next_batch()
        x = x + torch.randn_like(x) * 0.01 + random.random() * 1e-3 + float(np.random.rand()) * 1e-3
        loss = nn.functional.mse_loss(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.sched.step()
        self.extras.update(loss)
        self.log.append((loss.detach().clone(), random.random(), float(np.random.rand()), torch.rand(2)))

    def train(self, n: int) -> None:
        RNGState().load_state_dict(self.rng)  # trainers share the process-global streams: swap them
        for _ in range(n):
            self.step()
        self.rng = RNGState().state_dict()

    def restore(self, img: StateImage, **kwargs: Any) -> RestoreReport:
        rep = restore(self.registry, img, **kwargs)
        self.rng = RNGState().state_dict()
        return rep


def assert_trainers_equal(a: Trainer, b: Trainer) -> None:
    assert_log_and_registry_equal(a, b)
    assert_same(a.opt.param_groups[0]["lr"], b.opt.param_groups[0]["lr"], "lr")


def state_ptrs(t: Trainer) -> dict[str, int]:
    assert t.model is not None
    ptrs = {f"model.{k}": p.data_ptr() for k, p in t.model.named_parameters()}
    ptrs |= {f"model.{k}": b.data_ptr() for k, b in t.model.named_buffers()}
    for i, (p, st_) in enumerate(t.opt.state.items()):
        for k, v in st_.items():
            if isinstance(v, torch.Tensor):
                ptrs[f"optimizer.{i}.{k}"] = v.data_ptr()
    return ptrs


def by_name(rep: RestoreReport) -> dict[str, Any]:
    return {o.name: o for o in rep.objects}


# --- old vs new on survivors ----------------------------------------------------------


def _rollback_case(model_name: str, opt_name: str, k: int, ahead: int = 3, after: int = 4) -> None:
    ref = Trainer(model_name, opt_name)
    ref.train(k + after)
    old, new = Trainer(model_name, opt_name), Trainer(model_name, opt_name)
    old.train(k)
    new.train(k)
    img = Capturer(old.registry, "job", 0, chunk_bytes=4096).capture(version=k, generation=0)
    for t in (old, new):
        t.train(ahead)  # work that will be rolled back
        t.log = t.log[:k]
    ptrs = state_ptrs(new)
    rep_old = old.restore(img, in_place=False)
    rep_new = new.restore(img)
    assert not any(o.in_place for o in rep_old.objects)
    objs = by_name(rep_new)
    assert objs["model"].in_place, objs["model"].reason
    assert objs["optimizer"].in_place == (k > 0), objs["optimizer"].reason
    assert not objs["rng"].in_place and not objs["extras"].in_place and not objs["data"].in_place
    if k > 0:  # the live tensors were written, not replaced
        assert state_ptrs(new) == ptrs
    assert_trainers_equal(old, new)
    snapshot = copy.deepcopy({name: obj.state_dict() for name, obj in new.registry.items() if name != "rng"})
    img.buffer.fill_(0xAB)  # the mirror reuses the buffer: nothing restored may alias it
    for name, sd in snapshot.items():
        assert_same(sd, new.registry[name].state_dict(), name)
    old.train(after)
    new.train(after)
    assert_trainers_equal(old, new)
    assert_trainers_equal(ref, new)


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_in_place_equals_clone_path_and_keeps_tensors(model_name: str, opt_name: str) -> None:
    _rollback_case(model_name, opt_name, k=4)


@pytest.mark.parametrize("k", [0, 6])
def test_in_place_before_any_step_and_across_epoch(k: int) -> None:
    _rollback_case("mlp", "adamw", k=k)


@settings(max_examples=12, deadline=None)
@given(
    width=st.integers(1, 12),
    depth=st.integers(1, 3),
    opt_name=st.sampled_from(sorted(OPTIMIZERS)),
    k=st.integers(1, 7),
    ahead=st.integers(0, 3),
)
def test_in_place_equals_clone_path_hypothesis(width: int, depth: int, opt_name: str, k: int, ahead: int) -> None:
    MODELS["_h"] = lambda: mlp(width, depth)
    try:
        _rollback_case("_h", opt_name, k=k, ahead=ahead, after=2)
    finally:
        del MODELS["_h"]


# --- the restored-from image is a capture of the restored state (worker/reuse.py) ---------


def _assert_capture_is(img: StateImage, registry: StateRegistry) -> None:
    """Capturing right after the restore gives the image back, byte for byte and manifest for manifest
    (the generation aside): what lets a recovery mirror the image instead of capturing again."""
    m = img.manifest
    again = Capturer(registry, m.job_id, m.owner, chunk_bytes=m.chunk_bytes).capture(m.version, m.generation + 1)
    assert dataclasses.replace(again.manifest, generation=m.generation) == m
    assert torch.equal(again.buffer[: m.total_bytes], img.buffer[: m.total_bytes])


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_capture_after_restore_is_the_image(model_name: str, opt_name: str) -> None:
    survivor, replacement = Trainer(model_name, opt_name), Trainer(model_name, opt_name, init_seed=9)
    survivor.train(4)
    img = Capturer(survivor.registry, "job", 2, chunk_bytes=4096).capture(version=4, generation=3)
    img = StateImage(img.manifest, img.buffer.clone())
    survivor.train(2)  # the steps a rollback undoes
    for t in (survivor, replacement):  # in place (a survivor), and a fresh replacement (falls back)
        RNGState().load_state_dict(t.rng)
        t.restore(img)
        _assert_capture_is(img, t.registry)


# --- replacements and mismatches: per-object fallback -----------------------------------


def _image_at(k: int, opt_name: str = "adamw", model_name: str = "mlp") -> tuple[Trainer, StateImage]:
    src = Trainer(model_name, opt_name)
    src.train(k)
    img = Capturer(src.registry, "job", 3).capture(version=k, generation=1)
    return src, StateImage(img.manifest, img.buffer.clone())


def test_fresh_replacement_model_in_place_optimizer_falls_back() -> None:
    src, img = _image_at(5)
    ref = Trainer("mlp", "adamw")
    ref.train(9)
    old, new = Trainer("mlp", "adamw", init_seed=7), Trainer("mlp", "adamw", init_seed=7)
    assert not new.opt.state  # a fresh replacement: no moments yet
    old.restore(img, in_place=False)
    rep = by_name(new.restore(img))
    assert rep["model"].in_place
    assert not rep["optimizer"].in_place and "no live tensor" in rep["optimizer"].reason
    assert_trainers_equal(old, new)
    new.log = src.log[:]
    new.train(4)
    assert_trainers_equal(ref, new)


def test_changed_shape_raises_state_error_naming_object_and_key() -> None:
    _, img = _image_at(2)
    for in_place in (False, True):
        t = Trainer("mlp", "adamw", model=mlp(width=17))
        with pytest.raises(StateError, match=r"(?s)model\.load_state_dict\(\) failed.*size mismatch for 0\.weight"):
            restore(t.registry, img, in_place=in_place)


def test_changed_dtype_falls_back_and_matches_clone_path() -> None:
    _, img = _image_at(3)
    old, new = Trainer("mlp", "adamw", init_seed=1), Trainer("mlp", "adamw", init_seed=1)
    for t in (old, new):
        assert t.model is not None
        t.model.double()
    restore(old.registry, img, in_place=False)
    rep = by_name(restore(new.registry, img))
    assert not rep["model"].in_place and "torch.float64" in rep["model"].reason
    assert_trainers_equal(old, new)
    assert new.model is not None and next(new.model.parameters()).dtype == torch.float64


class Doubling(nn.Linear):
    """A module whose loading transforms values: in place would be wrong, so it must not be used."""

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        state_dict[prefix + "weight"] = state_dict[prefix + "weight"] * 2
        super()._load_from_state_dict(state_dict, prefix, *args)


class Copying(nn.Linear):
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return {k: v.clone() for k, v in super().state_dict(*args, **kwargs).items()}


def _hooked() -> nn.Module:
    m = nn.Linear(IN, 4)
    m.register_load_state_dict_post_hook(lambda module, keys: None)
    return m


@pytest.mark.parametrize(
    ("make", "why"),
    [
        (lambda: Doubling(IN, 4), "overrides _load_from_state_dict"),
        (lambda: Copying(IN, 4), "is not the live parameter"),
        (_hooked, "load_state_dict hooks"),
    ],
    ids=["load_override", "state_dict_copies", "load_hook"],
)
def test_non_standard_modules_fall_back_exactly(make: Callable[[], nn.Module], why: str) -> None:
    torch.manual_seed(0)
    src = make()
    reg = StateRegistry(include_rng=False)
    reg.protect(model=src)
    img = Capturer(reg, "job", 0).capture(0, 0)
    results = []
    for in_place in (False, True):
        torch.manual_seed(1)
        m = make()
        r = StateRegistry(include_rng=False)
        r.protect(model=m)
        rep = by_name(restore(r, img, in_place=in_place))
        results.append(m.state_dict())
        if in_place:
            assert not rep["model"].in_place and why in rep["model"].reason
    assert_same(results[0], results[1])


def test_optimizer_with_load_hook_or_shared_state_falls_back_exactly() -> None:
    src, img = _image_at(3, opt_name="sgd_momentum")
    hooked, shared, plain = (Trainer("mlp", "sgd_momentum") for _ in range(3))
    for t in (hooked, shared, plain):
        t.train(4)
    hooked.opt.register_load_state_dict_post_hook(lambda opt: None)
    p0, p1 = list(shared.opt.state)[:2]
    shared.opt.state[p1]["momentum_buffer"] = shared.opt.state[p0]["momentum_buffer"].view(-1)[: p1.numel()].view(p1.shape)
    restore(plain.registry, img, in_place=False)
    for t, why in ((hooked, "hooks"), (shared, "share memory")):
        rep = by_name(restore(t.registry, img))
        assert not rep["optimizer"].in_place and why in rep["optimizer"].reason
        assert_same(t.opt.state_dict(), plain.opt.state_dict())


def test_optimizer_group_mismatch_fails_before_touching_its_state() -> None:
    _, img = _image_at(3)  # AdamW, one param group
    t = Trainer("mlp", "adam_groups_amsgrad")  # two groups: load_state_dict must refuse
    t.train(2)
    before = copy.deepcopy(t.opt.state_dict())
    with pytest.raises(StateError, match="optimizer.load_state_dict.*different number of parameter groups"):
        restore(t.registry, img)
    assert_same(before, t.opt.state_dict())


def test_corrupt_image_touches_nothing_in_place_either() -> None:
    t = Trainer("mlp", "adamw")
    t.train(3)
    img = Capturer(t.registry, "job", 0, chunk_bytes=1024).capture(3, 0)
    t.train(2)
    before = copy.deepcopy({n: o.state_dict() for n, o in t.registry.items() if n not in ("rng",)})
    img.buffer[img.manifest.tensors[-3].offset + 1] ^= 0x01
    with pytest.raises(IntegrityError):
        restore(t.registry, img)
    for n, sd in before.items():
        assert_same(sd, t.registry[n].state_dict(), n)


def test_report_accounts_bytes_and_timings() -> None:
    t = Trainer("tied", "adamw")
    t.train(2)
    img = Capturer(t.registry, "job", 0).capture(2, 0)
    rep = restore(t.registry, img)
    assert rep.in_place_bytes + rep.cloned_bytes == sum(e.nbytes for e in img.manifest.tensors)
    assert [o.name for o in rep.fallbacks()] == ["extras", "rng"]
    assert rep.verify_s >= 0 and rep.load_s >= 0
    assert "neither an nn.Module nor a torch.optim.Optimizer" in by_name(rep)["rng"].reason
    assert by_name(rep)["scheduler"].reason == "no tensors"


def test_plan_rejects_live_tensor_inside_the_image_buffer() -> None:
    m = nn.Linear(3, 2)
    reg = StateRegistry(include_rng=False)
    reg.protect(model=m)
    img = Capturer(reg, "job", 0).capture(0, 0)
    e = img.manifest.tensors[0]
    with torch.no_grad():
        m.weight.data = img.buffer[e.offset : e.offset + e.nbytes].view(torch.float32).view(2, 3)
    sub = dict(img.manifest.tree["d"])["model"]
    with pytest.raises(inplace.NoPlan, match="inside the image buffer"):
        inplace.plan(m, sub, img.manifest.tensors, img.buffer)
    rep = by_name(restore(reg, img))
    assert not rep["model"].in_place and "inside the image buffer" in rep["model"].reason


# --- CUDA (skipped without a GPU; run on a lent GPU machine) -----------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("opt_kwargs", [{}, {"foreach": True}, {"fused": True}, {"capturable": True}], ids=str)
def test_cuda_in_place_equals_clone_path(opt_kwargs: dict[str, Any]) -> None:
    """Device tensors ("Td" in the tree): host-to-device copy_ into the live tensors, step tensors included."""

    def make() -> tuple[nn.Module, torch.optim.Optimizer, StateRegistry]:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, **opt_kwargs)
        reg = StateRegistry()
        reg.protect(model=m, optimizer=opt)
        return m, opt, reg

    def train(m: nn.Module, opt: torch.optim.Optimizer, n: int, seed: int) -> None:
        g = torch.Generator(device="cuda").manual_seed(seed)
        for _ in range(n):
            loss = m(torch.randn(16, 32, device="cuda", generator=g)).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    (m1, o1, r1), (m2, o2, r2) = make(), make()
    for m, o in ((m1, o1), (m2, o2)):
        train(m, o, 3, 1)
    img = Capturer(r1, "job", 0).capture(3, 0)
    assert "Td" in str(img.manifest.tree)
    for m, o in ((m1, o1), (m2, o2)):
        train(m, o, 2, 2)
    ptrs = [p.data_ptr() for p in m2.parameters()] + [
        v.data_ptr() for s in o2.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    ]
    restore(r1, img, in_place=False)
    rep = by_name(restore(r2, img))
    assert rep["model"].in_place and rep["optimizer"].in_place, (rep["model"].reason, rep["optimizer"].reason)
    assert ptrs == [p.data_ptr() for p in m2.parameters()] + [
        v.data_ptr() for s in o2.state.values() for v in s.values() if isinstance(v, torch.Tensor)
    ]
    assert_same(o1.state_dict(), o2.state_dict())
    assert_same(m1.state_dict(), m2.state_dict())
    img.buffer.fill_(0xAB)
    assert_same(m1.state_dict(), m2.state_dict())
    for m, o in ((m1, o1), (m2, o2)):
        train(m, o, 2, 3)
    assert_same(m1.state_dict(), m2.state_dict())
    assert_same(o1.state_dict(), o2.state_dict())


def test_decode_without_move_validates_devices_but_moves_nothing() -> None:
    from ckptless.state import decode

    t = torch.arange(3.0)
    assert decode({"Td": [0, "meta"]}, [t], move=False) is t
    assert decode({"Td": [0, "meta"]}, [t]).device.type == "meta"
    with pytest.raises(StateError, match="onto device"):
        decode({"Td": [0, "nosuchdevice:0"]}, [t], move=False)
