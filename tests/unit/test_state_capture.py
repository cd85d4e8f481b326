"""Capture/restore of training state: exactness, integrity, buffer reuse, registry validation."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from ckptless.data import ResumableLoader, ResumableSampler
from ckptless.errors import ConfigError, IntegrityError, ManifestError, StateError
from ckptless.state import ALIGN, Capturer, Manifest, StateImage, StateRegistry, restore

from ..harness.state import assert_log_and_registry_equal, assert_same


# --- a tiny but complete training setup --------------------------------------


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9, nesterov=True)


@dataclass
class Trainer:
    make_opt: Callable[[Any], torch.optim.Optimizer]
    init_seed: int
    log: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        torch.manual_seed(self.init_seed)
        random.seed(self.init_seed)
        np.random.seed(self.init_seed)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4))
        self.opt = self.make_opt(self.model.parameters())
        self.sched = torch.optim.lr_scheduler.OneCycleLR(self.opt, max_lr=0.05, total_steps=100)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
        g = torch.Generator().manual_seed(1234)  # the dataset is fixed data, not training state
        ds = TensorDataset(torch.randn(22, 8, generator=g), torch.randn(22, 4, generator=g))
        self.loader = ResumableLoader(ds, ResumableSampler(len(ds), seed=5), batch_size=4)
        self.registry = StateRegistry()
        self.registry.protect(model=self.model, optimizer=self.opt, scheduler=self.sched, scaler=self.scaler, data=self.loader)

    def step(self) -> None:
        x, y = self.loader.next_batch()
        jitter = torch.randn_like(x) * 0.01 + random.random() * 1e-3 + float(np.random.rand()) * 1e-3
        loss = nn.functional.mse_loss(self.model(x + jitter), y)
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.opt)
        self.scaler.update()
        self.sched.step()
        self.log.append((x.clone(), loss.detach().clone(), random.random(), float(np.random.rand()), torch.rand(2)))

    def train(self, n: int) -> None:
        for _ in range(n):
            self.step()


TOTAL = 13  # 22 samples / batch 4 = 6 batches per epoch: crosses two epoch boundaries


@pytest.mark.parametrize("make_opt", [_adamw, _sgd], ids=["adamw", "sgd"])
@pytest.mark.parametrize("k", [0, 4, 6])
def test_rollback_in_place_is_bitwise_exact(make_opt: Any, k: int) -> None:
    ref = Trainer(make_opt, init_seed=0)
    ref.train(TOTAL)

    run = Trainer(make_opt, init_seed=0)
    run.train(k)
    cap = Capturer(run.registry, job_id="job", owner=0, chunk_bytes=4096)
    img = cap.capture(version=k, generation=0)
    run.train(5)  # work that will be rolled back
    run.log = run.log[:k]
    restore(run.registry, img)
    run.train(TOTAL - k)
    assert_log_and_registry_equal(ref, run)


def test_replacement_from_wire_bytes_is_bitwise_exact() -> None:
    """A fresh process (different init, advanced RNG) restores from manifest JSON + raw bytes."""
    ref = Trainer(_adamw, init_seed=0)
    ref.train(TOTAL)

    src = Trainer(_adamw, init_seed=0)
    src.train(7)
    img = Capturer(src.registry, job_id="job", owner=3).capture(version=7, generation=2)
    wire_manifest = img.manifest.to_bytes()
    wire_buffer = img.buffer[: img.manifest.total_bytes].clone()

    repl = Trainer(_adamw, init_seed=99)
    repl.train(1)  # also creates optimizer state, which restore must replace
    random.random(), np.random.rand(), torch.rand(3)
    restore(repl.registry, StateImage(Manifest.from_bytes(wire_manifest), wire_buffer))
    repl.log = src.log[:]
    repl.train(TOTAL - 7)
    assert_log_and_registry_equal(ref, repl)


def test_restored_tensors_do_not_alias_the_buffer() -> None:
    t = Trainer(_adamw, init_seed=0)
    t.train(2)
    cap = Capturer(t.registry, "job", 0)
    img = cap.capture(1, 0)
    restore(t.registry, img)
    before = {k: v.clone() for k, v in t.opt.state_dict()["state"][0].items()}
    img.buffer.fill_(0xAB)  # the mirror reuses the buffer for the next capture
    assert_same(before, t.opt.state_dict()["state"][0])


def test_flipped_byte_is_caught_before_anything_is_loaded() -> None:
    t = Trainer(_adamw, init_seed=0)
    t.train(2)
    img = Capturer(t.registry, "job", 0, chunk_bytes=1024).capture(2, 0)
    t.train(1)
    after = [p.clone() for p in t.model.parameters()]
    img.buffer[img.manifest.tensors[1].offset + 3] ^= 0x10
    with pytest.raises(IntegrityError, match="corrupt chunk"):
        restore(t.registry, img)
    assert all(torch.equal(a, p) for a, p in zip(after, t.model.parameters()))
    restore(t.registry, img, verify=False)  # the caller may opt out (e.g. verified upstream)


def test_name_mismatch_is_rejected() -> None:
    t = Trainer(_adamw, init_seed=0)
    img = Capturer(t.registry, "job", 0).capture(0, 0)
    other = StateRegistry()
    other.protect(model=t.model)
    with pytest.raises(StateError, match="missing from image: \\[\\].*unknown: \\['data', 'optimizer'"):
        restore(other, img)


def test_layout_alignment_dtypes_and_noncontiguous() -> None:
    class Bag:
        def __init__(self) -> None:
            self.s: dict[str, Any] = {}

        def state_dict(self) -> dict[str, Any]:
            return self.s

        def load_state_dict(self, s: dict[str, Any]) -> None:
            self.s = s

    bag = Bag()
    base = torch.arange(60, dtype=torch.float64).reshape(6, 10)
    bag.s = {
        "t": base.t()[::2],
        "b": torch.tensor([True, False, True]),
        "h": torch.randn(3, dtype=torch.bfloat16),
        "c": torch.randn(2, dtype=torch.complex64),
        "e": torch.empty(0, 5),
        "z": torch.tensor(7, dtype=torch.int16),
        "np": np.arange(5, dtype=np.int32),
    }
    reg = StateRegistry(include_rng=False)
    reg.protect(bag=bag)
    cap = Capturer(reg, "job", 0, chunk_bytes=64)
    img = cap.capture(0, 0)
    assert all(e.offset % ALIGN == 0 for e in img.manifest.tensors)
    assert img.manifest.total_bytes == cap.required_bytes()
    want = dict(bag.s)
    bag.s = {}
    restore(reg, img)
    for k, v in want.items():
        got = bag.s[k]
        if isinstance(v, np.ndarray):
            assert isinstance(got, np.ndarray) and got.dtype == v.dtype and np.array_equal(got, v)
        else:
            assert got.dtype == v.dtype and got.shape == v.shape and torch.equal(got, v), k


def test_identical_state_gives_identical_image() -> None:
    t = Trainer(_adamw, init_seed=0)
    t.train(2)
    cap = Capturer(t.registry, "job", 0)
    a = cap.capture(0, 0, out=torch.full((cap.required_bytes() + 100,), 0xFF, dtype=torch.uint8))
    b = cap.capture(0, 0, out=torch.zeros(cap.required_bytes(), dtype=torch.uint8))
    assert a.manifest == b.manifest
    n = a.manifest.total_bytes
    assert torch.equal(a.buffer[:n], b.buffer[:n])


def test_buffer_too_small_or_wrong_kind() -> None:
    t = Trainer(_adamw, init_seed=0)
    cap = Capturer(t.registry, "job", 0)
    need = cap.required_bytes()
    with pytest.raises(StateError, match=f"needs {need} bytes, buffer has {need - 1}"):
        cap.capture(0, 0, out=torch.empty(need - 1, dtype=torch.uint8))
    with pytest.raises(StateError, match="uint8"):
        cap.capture(0, 0, out=torch.empty(need, dtype=torch.float32))
    img = cap.capture(0, 0)
    with pytest.raises(ManifestError):
        restore(t.registry, StateImage(img.manifest, img.buffer[: need - 1]))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_reused_buffer_no_growth_over_200_captures() -> None:
    model = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024))  # ~8 MiB
    reg = StateRegistry()
    reg.protect(model=model)
    cap = Capturer(reg, "job", 0)
    buf = cap.allocate()
    ptr = buf.data_ptr()
    for v in range(10):  # warm-up
        cap.capture(v, 0, out=buf)
    rss0 = _rss_bytes()
    for v in range(10, 210):
        img = cap.capture(v, 0, out=buf)
        assert img.buffer.data_ptr() == ptr
    grown = _rss_bytes() - rss0
    assert grown < 4 << 20, f"RSS grew by {grown} bytes over 200 captures"


def test_capturer_argument_validation() -> None:
    reg = StateRegistry()
    for kwargs, fld in [
        ({"job_id": "", "owner": 0}, "job_id"),
        ({"job_id": "j", "owner": -1}, "owner"),
        ({"job_id": "j", "owner": 0, "chunk_bytes": 0}, "chunk_bytes"),
    ]:
        with pytest.raises(ConfigError) as err:
            Capturer(reg, **kwargs)
        assert err.value.field == fld
    with pytest.raises(ConfigError, match="version"):
        Capturer(reg, "j", 0).capture(-1, 0)


# --- registry --------------------------------------------------------------


def test_registry_validates_names_and_objects() -> None:
    reg = StateRegistry()
    model = nn.Linear(2, 2)
    reg.protect(model=model)
    cases: list[tuple[dict[str, Any], str, Any]] = [
        ({"": model}, "name", ""),
        ({"9lives": model}, "name", "9lives"),
        ({"a-b": model}, "name", "a-b"),
        ({"class": model}, "name", "class"),
        ({"rng": model}, "name", "rng"),
        ({"model": model}, "name", "model"),
        ({"thing": 42}, "thing", 42),
        ({"ok": model, "bad": object}, "bad", object),
    ]
    for objs, fld, value in cases:
        with pytest.raises(ConfigError) as err:
            reg.protect(**objs)
        assert err.value.field == fld and err.value.value == value
        assert repr(value) in str(err.value)
    assert reg.names() == ["model", "rng"]  # nothing half-added
    assert "rng" in reg and len(reg) == 2
    assert StateRegistry(include_rng=False).names() == []


def test_ddp_model_is_protected_as_its_module() -> None:
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        inner = nn.Linear(3, 3)
        ddp = nn.parallel.DistributedDataParallel(inner)
        reg = StateRegistry()
        reg.protect(model=ddp)
        assert reg["model"] is inner
        img = Capturer(reg, "job", 0).capture(0, 0)
        plain = StateRegistry()
        plain.protect(model=nn.Linear(3, 3))
        restore(plain, img)
        assert torch.equal(plain["model"].state_dict()["weight"], inner.weight)  # type: ignore[index]
    finally:
        dist.destroy_process_group()
