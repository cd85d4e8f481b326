"""The layout key (ckptless.state.layout): equal exactly when one rank's objects can take another's image.

Pure checks on real state (a model, AdamW after steps, a scheduler), the holder's cache in
PeerStore.layout_of, and the wire forms that carry keys and any-rank adoptions to the leader
and the spare.
"""

from __future__ import annotations

import torch

from ckptless.mirror.store import PeerStore
from ckptless.recovery.decision import Assignment, RecoveryPlan
from ckptless.recovery.facts import ReplicaFact, Worker, WorkerReport
from ckptless.recovery.wire import (decision_from_doc, decision_to_doc, report_from_json, report_to_json,
                                    spare_from_json, spare_to_json)
from ckptless.state.capture import Capturer
from ckptless.state.layout import layout_key, manifest_layout_key, skeleton
from ckptless.state.manifest import TensorEntry
from ckptless.state.registry import StateRegistry


def _image(owner: int, hidden: int, steps: int, seed: int):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Linear(hidden, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(steps):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        sched.step()
    reg = StateRegistry()
    reg.protect(model=model, optimizer=opt, scheduler=sched)
    return Capturer(reg, "job", owner).capture(version=steps, generation=0)


def test_ranks_with_the_same_shapes_share_a_key_whatever_the_values_and_step() -> None:
    a, b = _image(0, 8, 3, seed=1), _image(1, 8, 5, seed=2)
    assert not torch.equal(a.buffer, b.buffer)
    assert manifest_layout_key(a.manifest) == manifest_layout_key(b.manifest)


def test_a_different_shape_or_lazily_missing_state_changes_the_key() -> None:
    base = manifest_layout_key(_image(0, 8, 3, seed=1).manifest)
    assert manifest_layout_key(_image(1, 9, 3, seed=1).manifest) != base
    assert manifest_layout_key(_image(1, 8, 0, seed=1).manifest) != base, "no AdamW moments yet: other tensors"


def test_dtensor_state_binds_the_key_to_its_owner() -> None:
    entries = (TensorEntry("float32", (4,), 0, 16),)
    plain = {"d": [["w", {"T": 0}]]}
    sharded = {"d": [["w", {"DT": [0, "mesh"]}]]}
    assert layout_key(entries, 16, 8, plain, 0) == layout_key(entries, 16, 8, plain, 3)
    assert layout_key(entries, 16, 8, sharded, 0) != layout_key(entries, 16, 8, sharded, 3)
    assert skeleton({"d": [["lr", 0.5], ["on", True], ["n", None]]})[0] == {"d": [["lr", "#"], ["on", "?"], ["n", None]]}


def test_holder_caches_the_key_per_slot_and_forgets_it_with_the_image() -> None:
    s = PeerStore("job")
    first = _image(2, 8, 3, seed=1)
    s.put(first.manifest, first.buffer)
    assert s.layout_of(2, 3) == manifest_layout_key(first.manifest)
    assert s.layout_of(2, 99) == "" and s.layout_of(5, 3) == ""
    grown = _image(2, 9, 4, seed=1)  # a newer version, another layout, into the other slot
    s.put(grown.manifest, grown.buffer)
    newer = _image(2, 9, 5, seed=1)  # replaces the oldest slot (v3): its cached key must go with it
    s.put(newer.manifest, newer.buffer)
    assert s.layout_of(2, 3) == ""
    assert s.layout_of(2, 5) == manifest_layout_key(newer.manifest) != manifest_layout_key(first.manifest)


def test_wire_carries_keys_spare_flags_and_adoptions() -> None:
    rep = WorkerReport("a/w0", 3, 3, frozenset({3}), (ReplicaFact(1, 3, 4, "abc"), ReplicaFact(2, 3, 4)),
                       ((3, "def"),))
    assert report_from_json(report_to_json(rep)) == rep
    legacy = b'{"worker_id": "a/w0", "newest_captured": 3, "committed": 3, "local_versions": [3], "replicas": [[1, 3, 4]]}'
    assert report_from_json(legacy).replicas == (ReplicaFact(1, 3, 4, ""),)
    w = Worker("c/spare0", "c", 2, True)
    assert spare_from_json(spare_to_json(w)) == w
    assert spare_from_json(b'{"worker_id": "c/s", "node_id": "c", "standby_rank": 1}').any_rank is False
    plan = RecoveryPlan("job", 2, (Assignment(0, "a/w0", "a", "survivor"), Assignment(1, "c/spare0", "c", "spare")),
                        (1,), 3, (), (), True, (), 0, adopt_prebuilt=(1,))
    assert decision_from_doc(decision_to_doc(plan)) == plan
