"""DDP and FSDP2 models protected and restored exactly (issue 10).

Two halves:

* single-process checks (world size 1, Gloo): the DTensor leaf encoding and
  its strict validation, in-place and rebuilt DTensor restores, the DDP
  reducer tracker's phases and replays, refusals, and a pin of every private
  torch API the state package relies on (torch 2.13);
* real processes (4 ranks, Gloo, a TCPStore hosted here so it outlives the
  workers): DDP (default and ``gradient_as_bucket_view``) and FSDP2 trained
  together; one rank is SIGKILLed at a kill point, the survivors recover in
  their processes, a replacement process takes over the dead rank from its
  last image, and every rank's final parameters, optimizer state, FSDP shards
  and DDP reducer state must equal a fault-free run's (``torch.equal``).
"""

from __future__ import annotations

import importlib.metadata
import json
import multiprocessing as mp
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from packaging.requirements import Requirement
from packaging.version import Version
from torch import nn

from ckptless.errors import ConfigError, ManifestError, StateError
from ckptless.state import Capturer, StateImage, StateRegistry, decode, encode, restore
from ckptless.state import fsdp as ck_fsdp
from ckptless.state.ddp import DDPReducerState
from ckptless.state.dtensor import Meshes
from ckptless.state.manifest import Manifest

from ..harness import ddp_fsdp_workers as workers
from ..harness.torch_touchpoints import reset_iter_state_api

JOIN_S = 150.0


# --- single process ----------------------------------------------------------------------------------------
@pytest.fixture
def world1() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fsdp_model(seed: int = 0) -> tuple[Any, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    fully_shard(m[0], mesh=mesh)
    fully_shard(m[2], mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m, torch.optim.AdamW(m.parameters(), lr=0.05)


def _train(m: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        m(torch.randn(5, 4, generator=g)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()


def _local(x: Any) -> Any:
    return x.to_local() if hasattr(x, "to_local") else x


def _same_state(m1: nn.Module, o1: torch.optim.Optimizer, m2: nn.Module, o2: torch.optim.Optimizer) -> bool:
    ok = all(torch.equal(_local(a), _local(b)) for a, b in zip(m1.parameters(), m2.parameters()))
    s1, s2 = o1.state_dict()["state"], o2.state_dict()["state"]
    return ok and s1.keys() == s2.keys() and all(
        torch.equal(_local(s1[i][k]), _local(s2[i][k])) for i in s1 for k in s1[i])


def _copy(img: StateImage) -> StateImage:
    return StateImage(Manifest.from_bytes(img.manifest.to_bytes()), img.buffer.clone())


def test_dtensor_leaf_is_local_shard_plus_typed_metadata(world1: None) -> None:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    m, opt = _fsdp_model()
    _train(m, opt, 1, 0)
    w = m[0].weight
    tree, tensors = encode({"w": w, "m": opt.state_dict()["state"][0]["exp_avg"]})
    node = tree["d"][0][1]
    assert node == {"DT": [{"T": 0}, [["S", 0]], [8, 4], [4, 1], ["cpu", [1], ["dp"], [0]]]}
    assert json.loads(json.dumps(tree)) == tree
    assert torch.equal(tensors[0], w.to_local()) and type(tensors[0]) is torch.Tensor
    plain = decode(tree, tensors)  # no meshes: each rank's shard as a plain tensor (the disk writer's view)
    assert type(plain["w"]) is torch.Tensor
    rebuilt = decode(tree, [t.clone() for t in tensors], meshes=Meshes([m]))
    assert isinstance(rebuilt["w"], DTensor) and rebuilt["w"].placements == (Shard(0),)
    assert rebuilt["w"].device_mesh is w.device_mesh and rebuilt["w"].stride() == w.stride()
    assert torch.equal(rebuilt["w"].to_local(), w.to_local())
    # Replicate and Partial round-trip too
    r = DTensor.from_local(torch.arange(6.0).view(2, 3), w.device_mesh, [Replicate()], run_check=False)
    p = DTensor.from_local(torch.ones(2), w.device_mesh, [Partial("max")], run_check=False)
    tree2, t2 = encode({"r": r, "p": p})
    out = decode(tree2, t2, meshes=Meshes([m]))
    assert out["r"].placements == (Replicate(),) and out["p"].placements == (Partial("max"),)


@pytest.mark.parametrize("mutate, needle", [
    (lambda n: n["DT"].pop(), "payload must be"),
    (lambda n: n["DT"].__setitem__(0, [0]), "local shard is not a tensor node"),
    (lambda n: n["DT"].__setitem__(1, [["S", 2]]), "placement"),
    (lambda n: n["DT"].__setitem__(1, [["P", "xor"]]), "placement"),
    (lambda n: n["DT"].__setitem__(1, [["R"], ["R"]]), "one entry per mesh dimension"),
    (lambda n: n["DT"].__setitem__(2, [8, -4]), "shape"),
    (lambda n: n["DT"].__setitem__(2, [4, 4]), "does not fit global shape"),
    (lambda n: n["DT"].__setitem__(3, [4]), "stride and shape"),
    (lambda n: n["DT"][4].__setitem__(1, [2]), "mesh ranks"),
    (lambda n: n["DT"][4].__setitem__(2, ["a", "b"]), "dim names"),
    (lambda n: n["DT"][4].__setitem__(3, ["0"]), "mesh ranks"),
    (lambda n: n["DT"].__setitem__(4, "cpu"), "mesh must be"),
])
def test_malformed_dtensor_metadata_is_rejected_naming_the_path(world1: None, mutate: Any, needle: str) -> None:
    m, _ = _fsdp_model()
    tree, tensors = encode({"model": {"w": m[0].weight}})
    node = tree["d"][0][1]["d"][0][1]
    mutate(node)
    with pytest.raises(ManifestError, match=needle) as err:
        decode(tree, tensors)
    assert "model.w" in str(err.value)


def test_unsupported_placement_is_refused_at_capture(world1: None) -> None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    m, _ = _fsdp_model()
    odd = DTensor.from_local(torch.ones(4), m[0].weight.device_mesh, [_StridedShard(0, split_factor=2)],
                             run_check=False)
    with pytest.raises(StateError, match=r"extra\.odd: DTensor placement"):
        encode({"odd": odd}, "extra")


def test_fsdp_restore_in_place_and_into_a_fresh_replacement(world1: None) -> None:
    m, opt = _fsdp_model()
    _train(m, opt, 2, 1)
    reg = StateRegistry()
    reg.protect(model=m, optimizer=opt)
    img = Capturer(reg, "j", 0).capture(2, 0)
    ptrs = [p.to_local().data_ptr() for p in m.parameters()]
    moments = [id(v) for s in opt.state.values() for v in s.values()]
    ref_m, ref_o = _fsdp_model()
    restore_ref = StateRegistry()
    restore_ref.protect(model=ref_m, optimizer=ref_o)
    restore(restore_ref, _copy(img))  # a "replacement": fresh model, optimizer without state
    _train(m, opt, 2, 2)  # the survivor moves on, then rolls back
    rep = restore(reg, img)
    assert [o.name for o in rep.fallbacks()] == ["rng"], rep  # FSDP2 model and its optimizer: in place
    assert ptrs == [p.to_local().data_ptr() for p in m.parameters()]
    assert moments == [id(v) for s in opt.state.values() for v in s.values()]
    assert _same_state(m, opt, ref_m, ref_o)
    _train(m, opt, 2, 3)
    _train(ref_m, ref_o, 2, 3)
    assert _same_state(m, opt, ref_m, ref_o)
    img.buffer.fill_(7)  # nothing aliases the image
    assert _same_state(m, opt, ref_m, ref_o)


def test_missing_mesh_is_a_clear_error_naming_the_path(world1: None) -> None:
    m, _ = _fsdp_model()

    class Holder:
        def __init__(self, v: Any) -> None:
            self.v = v

        def state_dict(self) -> dict[str, Any]:
            return {"v": self.v}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.v = sd["v"]

    src = StateRegistry()
    src.protect(extra=Holder(m[0].weight.detach()))
    img = Capturer(src, "j", 0).capture(0, 0)
    dst = StateRegistry()
    dst.protect(extra=Holder(None))  # no protected object lives on a mesh
    with pytest.raises(StateError, match=r"extra\.v: no protected object lives on a device mesh cpu \[1\]"):
        restore(dst, _copy(img))
    ok = StateRegistry()
    holder = Holder(m[0].weight.detach() * 0)  # its live state names the mesh
    ok.protect(extra=holder)
    restore(ok, _copy(img))
    assert torch.equal(holder.v.to_local(), m[0].weight.to_local())


def test_fsdp_reset_after_failure_is_safe_without_a_failure(world1: None) -> None:
    m, opt = _fsdp_model()
    assert ck_fsdp.reset_after_failure(m)  # never forwarded: nothing to reset, no error
    _train(m, opt, 1, 0)
    m(torch.randn(2, 4)).sum().backward()
    assert all(p.grad is not None for p in m.parameters())
    reg = StateRegistry()
    reg.protect(model=m, plain=nn.Linear(2, 2))
    assert reg.reset_after_failure() == ["model"]
    assert all(p.grad is None for p in m.parameters())
    _train(m, opt, 1, 1)  # trains on


def _ddp(**kw: Any) -> tuple[nn.parallel.DistributedDataParallel, torch.optim.Optimizer]:
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))
    ddp = nn.parallel.DistributedDataParallel(inner, bucket_cap_mb=0.05, **kw)
    return ddp, torch.optim.SGD(inner.parameters(), lr=0.01, momentum=0.9)


@pytest.mark.parametrize("view", [False, True])
def test_ddp_reducer_phases_captured_and_replayed_both_ways(world1: None, view: bool) -> None:
    ddp, opt = _ddp(gradient_as_bucket_view=view)
    reg = StateRegistry()
    reg.protect(model=ddp, optimizer=opt)
    assert reg.names() == ["model", "__ddp__model", "optimizer", "rng"]
    cap = Capturer(reg, "j", 0)
    g = torch.Generator().manual_seed(0)

    def step() -> None:
        ddp(torch.randn(4, 64, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        reg.step_done()

    imgs = [cap.capture(0, 0)]
    for v in range(3):
        step()
        imgs.append(cap.capture(v + 1, 0))
    states = [dict(im.manifest.tree["d"][1][1]["d"]) for im in imgs]
    assert [s["phase"] for s in states] == ["fresh", "pushed", "rebuilt", "rebuilt"]
    assert states[1]["order"] == [5, 4, 3, 2, 1, 0] and len(states[2]["layout"]) > 1
    tracker = reg["__ddp__model"]
    assert isinstance(tracker, DDPReducerState)
    reducer = ddp.reducer
    for target in (1, 0, 3, 2, 1, 3, 0):  # every direction, incl. rebuilt -> fresh (a new reducer)
        restore(reg, imgs[target])
        assert tracker.state_dict() == states[target] or (
            states[target]["phase"] == "pushed" and tracker.state_dict()["order"] == states[target]["order"])
        assert all(p.grad is None for p in ddp.parameters())
    assert ddp.reducer is not reducer  # back to fresh from rebuilt needed the constructor's layout again
    # training on from a restored state matches an uninterrupted run of the same steps
    ref, ref_opt = _ddp(gradient_as_bucket_view=view)
    ref_reg = StateRegistry()
    ref_reg.protect(model=ref, optimizer=ref_opt)
    restore(reg, imgs[1])
    restore(ref_reg, _copy(imgs[1]))
    for _ in range(2):
        x = torch.randn(4, 64, generator=g)
        for d, o in ((ddp, opt), (ref, ref_opt)):
            d(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(ddp.parameters(), ref.parameters()))
    assert reg["__ddp__model"].state_dict() == ref_reg["__ddp__model"].state_dict()


def test_ddp_refusals_and_plain_restore(world1: None) -> None:
    reg = StateRegistry()
    for kw in ({"find_unused_parameters": True}, {"static_graph": True}):
        ddp, _ = _ddp(**kw)
        with pytest.raises(ConfigError, match="cannot be restored exactly"):
            reg.protect(model=ddp)
    ddp, _ = _ddp()
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ddp.register_comm_hook(None, allreduce_hook)
    with pytest.raises(ConfigError, match="comm hook"):
        reg.protect(model=ddp)
    with pytest.raises(ConfigError, match="reserved"):
        reg.protect(__ddp__x=nn.Linear(1, 1))
    assert reg.names() == ["rng"]
    ddp, _ = _ddp()
    reg.protect(model=ddp)
    with pytest.raises(ConfigError):
        reg.unprotect("__ddp__model")
    img = Capturer(reg, "j", 0).capture(0, 0)
    plain = StateRegistry()
    plain.protect(model=_ddp()[0].module)  # an unwrapped module restores the same image
    restore(plain, _copy(img))
    bad = json.loads(img.manifest.to_bytes())
    bad["tree"]["d"][1][1]["d"][0][1] = "sideways"
    with pytest.raises(StateError, match="unknown phase 'sideways'"):
        restore(reg, StateImage(Manifest.from_bytes(json.dumps(bad).encode()), img.buffer))
    reg.unprotect("model")
    assert reg.names() == ["rng"]


def test_private_torch_apis_used_are_pinned() -> None:
    """The state package relies on these torch internals; a torch outside the range ckptless declares must
    re-verify them (which version was checked how: docs/compatibility.md). ``FSDPModule.reset_iter_state``
    may be missing (torch 2.11): ckptless then resets FSDP2's fields itself, whose presence the
    touchpoint checks (test_survivors_reset_fsdp2_on_a_torch_without_reset_iter_state runs that path)."""
    declared = next(r for r in importlib.metadata.requires("ckptless") or [] if Requirement(r).name == "torch")
    assert Requirement(declared).specifier.contains(Version(torch.__version__).public), (torch.__version__, declared)
    ddp_cls = nn.parallel.DistributedDataParallel
    for name in ("_build_params_for_reducer", "_build_debug_param_to_name_mapping", "_ddp_init_helper"):
        assert callable(getattr(ddp_cls, name)), name
    for name in ("_autograd_hook", "_rebuild_buckets", "_reset_state", "_get_zeros_like_grad_buckets",
                 "_remove_autograd_hooks", "prepare_for_backward"):
        assert callable(getattr(dist.Reducer, name)), name
    from torch.distributed.fsdp import FSDPModule

    assert callable(FSDPModule._get_fsdp_state)
    reset = reset_iter_state_api()  # "yes" where torch has the method, "yes: absent, ckptless's fallback" else
    assert not reset.startswith("no"), reset


def test_private_fsdp_and_ddp_behaviour_pinned(world1: None) -> None:
    """Behaviour (not just names) the package relies on, on the installed torch."""
    m, opt = _fsdp_model()
    _train(m, opt, 1, 0)
    pre, post = ck_fsdp.load_hook_ids(m)
    assert pre and post  # FSDP2 registers both kinds (the pre-hooks at its first forward); restore admits these
    assert pre == {h.id for g in m[0]._get_fsdp_state()._fsdp_param_groups
                   for h in g._module_to_pre_load_state_dict_hook_handle.values()} | {
                  h.id for g in m[2]._get_fsdp_state()._fsdp_param_groups
                  for h in g._module_to_pre_load_state_dict_hook_handle.values()}
    assert set(m[0]._load_state_dict_post_hooks) | set(m[2]._load_state_dict_post_hooks) == post
    assert m._get_fsdp_state()._is_root is True
    assert m[0]._get_fsdp_state()._is_root is False
    for sub in (m[0], m[2]):
        (group,) = sub._get_fsdp_state()._fsdp_param_groups
        assert group._all_gather_result is None  # between steps
        assert all(p._post_load_hook_handle.id in post for p in group.fsdp_params)
    ddp, _ = _ddp()
    buckets = ddp.reducer._get_zeros_like_grad_buckets()
    assert [[id(p) for p in b.parameters()] for b in buckets] == [[id(p) for p in ddp.module.parameters()]]


# --- real processes ------------------------------------------------------------------------------------------
def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([workers.__name__])  # torch imported once, workers forked from it
    return ctx


def _run(tmp: Path, point: str = "", kill_step: int = -1, victim: int = -1, lag: int = 0,
         without_reset_api: bool = False) -> dict[int, dict[str, Any]]:
    from datetime import timedelta

    ctx = _context()
    tmp.mkdir(parents=True, exist_ok=True)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=JOIN_S))

    def start(rank: int, generation: int = 0, image: str = "") -> Any:
        args = workers.Args(rank, store.port, str(tmp), point, kill_step, victim, generation, image, lag, without_reset_api)
        p = ctx.Process(target=workers.worker, args=(args,), name=f"rank{rank}-g{generation}")
        p.start()
        return p

    procs = {r: start(r) for r in range(workers.WORLD)}
    try:
        if point:
            store.wait(["victim_ready"], timedelta(seconds=JOIN_S))
            procs[victim].kill()  # SIGKILL
            procs[victim].join(JOIN_S)
            procs[victim] = start(victim, 1, workers.image_path(str(tmp), victim, max(0, kill_step - lag)))
        for r, p in procs.items():
            p.join(JOIN_S)
            assert p.exitcode == 0, f"rank {r} exited with {p.exitcode}"
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join(10)
    return {r: torch.load(tmp / f"rank{r}.pt", weights_only=True) for r in range(workers.WORLD)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, Any]]:
    return _run(tmp_path_factory.mktemp("fault_free"))


def _assert_equal(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            _assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}.{i}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _phase(version: int) -> str:
    return "fresh" if version == 0 else "pushed" if version == 1 else "rebuilt"


def _expected_ddp_actions(point: str, kill_step: int, lag: int, replacement: bool) -> dict[str, str]:
    """What restoring each DDP reducer must do (see ckptless/state/ddp.py)."""
    target = _phase(max(0, kill_step - lag))
    out = {}
    for k in ("a", "b"):
        live, touched = _phase(kill_step), False
        if replacement:
            live = "fresh"
        elif k == "a" or point != "ddp_a_bwd":  # this DDP ran a forward in the failed step
            touched = True
            live = "rebuilt" if live == "pushed" else live  # that forward rebuilt the buckets
        if not touched and live == target:
            out[k] = "kept"
        elif target == "fresh":
            out[k] = "new reducer" if live == "rebuilt" else "reset"
        else:
            out[k] = f"replayed {target}"
    return out


def _check(ref: dict[int, dict[str, Any]], got: dict[int, dict[str, Any]], point: str, kill_step: int,
           victim: int, lag: int = 0) -> None:
    for r in range(workers.WORLD):
        facts = got[r]["facts"]
        assert got[r]["generation"] == 1
        (restored,) = facts["restores"]
        objects = restored["objects"]
        if r == victim:
            assert facts["replacement"] and not facts["failures"]
            assert all(ok for name, ok, _ in objects if name in ("a", "b", "c")), objects  # fresh model: in place
            if kill_step - lag > 0:  # a DDP replay is needed: refused outside local_only, before touching anything
                assert "local_only()" in facts["outside_local_only"], facts["outside_local_only"]
        else:
            assert [s for s, _ in facts["failures"]] == [kill_step], facts["failures"]
            assert facts["fsdp_reset"] == ["c"]
            tensors = {"a", "b", "c", "opt_a", "opt_b", "opt_c"} if kill_step - lag > 0 else {"a", "b", "c"}
            assert all(ok for name, ok, _ in objects if name in tensors), objects  # survivors: in place
        assert restored["ddp"] == _expected_ddp_actions(point, kill_step, lag, r == victim), (r, restored["ddp"])
        for key in ("a", "b", "c", "opt_a", "opt_b", "opt_c", "ddp"):
            _assert_equal(ref[r][key], got[r][key], f"rank{r}.{key} ({point} at step {kill_step}, victim {victim})")


FAST = [  # every phase, both DDP flavours, both FSDP2 kill points, rank 0 and rank 3 as the victim
    ("ddp_a_bwd", 0, 3),  # first step: restore to "fresh" (survivors hold partial pushes)
    ("ddp_b_bwd", 1, 0),  # second step: "pushed" (survivors already rebuilt in this step's forward)
    ("ddp_a_bwd", 3, 0),  # later: "rebuilt"
    ("fsdp_fwd", 2, 3),
    ("fsdp_bwd", 3, 0),
]
SLOW = [(p, k, v) for p in workers.POINTS for k in (0, 1, 3) for v in (0, 3) if (p, k, v) not in FAST]


@pytest.mark.parametrize("point, kill_step, victim", FAST)
def test_kill_and_recover_bitwise_equal(reference: dict[int, dict[str, Any]], tmp_path: Path, point: str,
                                        kill_step: int, victim: int) -> None:
    _check(reference, _run(tmp_path, point, kill_step, victim), point, kill_step, victim)


@pytest.mark.parametrize("point, kill_step, victim", [("fsdp_bwd", 3, 0), ("fsdp_fwd", 2, 3)])
def test_survivors_reset_fsdp2_on_a_torch_without_reset_iter_state(reference: dict[int, dict[str, Any]], tmp_path: Path,
                                                                  point: str, kill_step: int, victim: int) -> None:
    """torch 2.11 (the GPU machine's) has no ``FSDPModule.reset_iter_state``: the survivors' reset takes
    ckptless's fallback on FSDP2's fields, and the run stays bitwise equal to the fault-free one."""
    _check(reference, _run(tmp_path, point, kill_step, victim, without_reset_api=True), point, kill_step, victim)


@pytest.mark.parametrize("lag", [3, 2])
def test_restore_older_committed_step_bitwise_equal(reference: dict[int, dict[str, Any]], tmp_path: Path,
                                                   lag: int) -> None:
    """Mirrors commit behind training: survivors with rebuilt buckets go back to "fresh" (a new
    reducer: the constructor's layout) or "pushed" (reset and replay) and retrain the lost steps."""
    _check(reference, _run(tmp_path, "fsdp_fwd", 3, 3, lag=lag), "fsdp_fwd", 3, 3, lag)


@pytest.mark.slow
@pytest.mark.parametrize("point, kill_step, victim", SLOW)
def test_kill_and_recover_bitwise_equal_full_matrix(reference: dict[int, dict[str, Any]], tmp_path: Path,
                                                    point: str, kill_step: int, victim: int) -> None:
    _check(reference, _run(tmp_path, point, kill_step, victim), point, kill_step, victim)
