"""The node-local tier (issue 9), unit level: the planner rule R9 (pure, hypothesis), its facts and
wire records, the own-image files in shm (writer and readers), and the respawn's restore from them.

End to end (real launcher, SIGKILL, bitwise equal): tests/e2e/test_node_local_e2e.py.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ckptless.errors import ConfigError, IntegrityError
from ckptless.mirror import ownimage
from ckptless.mirror.ownimage import NodeLocalImageError, OwnImageFiles
from ckptless.mirror.shm import cleanup_job, list_files, own_files, own_path, parse_name
from ckptless.recovery import PlanningFacts, PlanPolicy, RecoveryPlan, Unrecoverable, WaitForReplacement, Worker
from ckptless.recovery.decision import Assignment, DiskFallback, LocalRestore
from ckptless.recovery.executor import RestoreInputs, apply_decision
from ckptless.recovery.facts import NodeLocalImage
from ckptless.recovery.gather import plan_from_view
from ckptless.recovery.plan import plan_recovery
from ckptless.recovery.view import ExitRecord
from ckptless.recovery.wire import Membership, decision_from_doc, decision_to_doc
from ckptless.state.capture import Capturer
from ckptless.state.checksum import chunk_checksums
from ckptless.state.manifest import Manifest
from ckptless.state.registry import StateRegistry

from ..harness.leader_sim import World as SimWorld
from ..harness.mirror import init_gloo, start_and_join
from ..harness.plan_worlds import SETTINGS, example_facts, oracle_avail, worlds

JOB = "job/node-local"
CHUNK = 4096


# --- the planner rule (pure) ------------------------------------------------------------------------
@st.composite
def worlds_with_local(draw: st.DrawFn) -> PlanningFacts:
    """The planner's random worlds, plus node-local images some lost ranks left on their (maybe dead) node."""
    w = draw(worlds())
    f = w.facts
    if draw(st.booleans()):  # no spares: every lost rank on a live node respawns there
        f = replace(f, spares=())
    if draw(st.booleans()):  # the ranks' nodes are alive (processes killed, not nodes lost)
        f = replace(f, dead_nodes=frozenset())
    rnd = random.Random(draw(st.integers(0, 2**32)))
    c = w.committed  # an agent finds a committed version, mostly the newest one
    imgs = []
    for r in f.lost_ranks:
        if rnd.random() < 0.7:
            imgs.append(NodeLocalImage(r, f.slot(r).worker.node_id, rnd.choice([c, c, c, max(0, c - 1), c + 1]),
                                       rnd.randint(0, 40), rnd.randint(0, 3)))
    return replace(f, node_local=tuple(imgs))


def _avail_with_local(f: PlanningFacts, assignments: tuple[Assignment, ...]) -> tuple[dict[int, set[int]], dict]:
    """The naive oracle: survivors' and holders' versions, plus a node-local image's version for the
    rank whose new worker is a respawn on that image's node; capped as the planner caps."""
    by_rank = {a.rank: a for a in assignments}
    usable = {i.rank: i for i in f.node_local
              if by_rank[i.rank].source == "respawn" and by_rank[i.rank].node_id == i.node_id}
    uncapped = replace(f, policy=PlanPolicy(f.policy.prefer, resume_beyond_committed=True), node_local=())
    avail = oracle_avail(uncapped)
    for r, img in usable.items():
        avail[r].add(img.version)
    if not f.policy.resume_beyond_committed:
        cap = max((r.committed for r in f.reports if r.committed is not None), default=-1)
        avail = {r: {v for v in vs if v <= cap} for r, vs in avail.items()}
    return avail, usable


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds_with_local())
def test_r9_plan_matches_oracle(f: PlanningFacts) -> None:
    d = plan_recovery(f)
    d0 = plan_recovery(replace(f, node_local=()))
    event(f"{type(d0).__name__} -> {type(d).__name__}")
    if isinstance(d, WaitForReplacement):  # the same ranks lack a worker (R9 may have made it recoverable)
        assert isinstance(d0, (WaitForReplacement, Unrecoverable))
        assert not isinstance(d0, WaitForReplacement) or d.unassigned_ranks == d0.unassigned_ranks
        return
    if isinstance(d, Unrecoverable):
        assert isinstance(d0, Unrecoverable), "a node-local image never makes a recoverable loss unrecoverable"
        return
    assert not isinstance(d0, WaitForReplacement)
    assert d.assignments == getattr(d0, "assignments", d.assignments), "who takes a rank does not depend on R9"
    avail, usable = _avail_with_local(f, d.assignments)
    common = set.intersection(*avail.values())
    if isinstance(d, DiskFallback):
        assert not common
        return
    assert isinstance(d, RecoveryPlan)
    r = d.resume_version
    assert common and r == max(common)
    if isinstance(d0, RecoveryPlan):
        assert r >= d0.resume_version, "more copies never resume from an older version"
    by_rank = {a.rank: a for a in d.assignments}
    want_local = sorted(x for x, img in usable.items() if img.version == r)
    assert [x.rank for x in d.node_local] == want_local
    event(f"ranks restored from node-local memory: {min(len(want_local), 2)}")
    for x in d.node_local:
        a = by_rank[x.rank]
        assert a.source == "respawn" and (x.worker_id, x.node_id) == (a.worker_id, a.node_id)
        img = usable[x.rank]
        assert (x.version, x.n_chunks, x.generation) == (img.version, img.n_chunks, img.generation)
        assert f.slot(x.rank).worker.node_id == x.node_id, "never another node's image"
    assert not {t.owner for t in d.transfers} & set(want_local), "holders never send a node-local rank's stripes"
    alive_rank = {s.worker.worker_id: s.rank for s in f.members if s.alive}
    local = {alive_rank[rep.worker_id]: rep for rep in f.reports}
    needing = sorted(x for x in range(f.world_size) if x not in local or r not in local[x].local_versions)
    assert [t.owner for t in d.transfers] == [x for x in needing if x not in want_local]
    if isinstance(d0, RecoveryPlan) and d0.resume_version == r:
        # Otherwise unchanged: the same plan, minus the stripes of the ranks that read their node's copy.
        expect = replace(d0, transfers=tuple(t for t in d0.transfers if t.owner not in want_local),
                         node_local=d.node_local)
        assert d == expect


@SETTINGS
@given(worlds_with_local(), st.integers(0, 2**32))
def test_r9_deterministic_and_order_independent(f: PlanningFacts, seed: int) -> None:
    imgs = list(f.node_local)
    random.Random(seed).shuffle(imgs)
    assert plan_recovery(f) == plan_recovery(replace(f, node_local=tuple(imgs)))


def _local(rank: int = 1, node: str = "a", version: int = 100, n: int = 10) -> NodeLocalImage:
    return NodeLocalImage(rank, node, version, n, 7)


def test_example_respawn_reads_its_node_copy_and_holder_sends_nothing() -> None:
    d = plan_recovery(replace(example_facts(), node_local=(_local(),)))  # no spare: rank 1 respawns on node a
    assert isinstance(d, RecoveryPlan) and d.resume_version == 100 and not d.transfers
    assert d.node_local == (LocalRestore(1, "a/respawn-g8-r1", "a", 100, 10, 7),)
    assert [(b.rank, b.from_version) for b in d.rollbacks] == [(0, 101), (3, 101)]


def test_example_a_spare_or_another_version_never_uses_it() -> None:
    spare = plan_recovery(replace(example_facts(spares=(Worker("c/spare", "c"),)), node_local=(_local(),)))
    assert isinstance(spare, RecoveryPlan) and not spare.node_local
    assert [(t.owner, t.receiver) for t in spare.transfers] == [(1, "c/spare")]
    respawn = plan_recovery(replace(example_facts(spares=(Worker("c/spare", "c"),), prefer="respawn"),
                                    node_local=(_local(),)))
    assert isinstance(respawn, RecoveryPlan) and [x.rank for x in respawn.node_local] == [1]
    older = plan_recovery(replace(example_facts(), node_local=(_local(version=99),)))
    assert isinstance(older, RecoveryPlan) and older.resume_version == 100 and not older.node_local
    assert [t.owner for t in older.transfers] == [1]


def test_example_node_local_copy_covers_a_loss_beyond_k() -> None:
    """Rank 1 and its only holder (rank 2) die: without the node-local copy only the disk remains."""
    base = example_facts()
    members = tuple(replace(s, alive=s.rank not in (1, 2)) for s in base.members)
    reports = tuple(r for r in base.reports if r.worker_id != "b/w2")
    f = replace(base, members=members, reports=reports)
    assert isinstance(plan_recovery(f), DiskFallback)
    d = plan_recovery(replace(f, node_local=(_local(),)))
    assert isinstance(d, RecoveryPlan) and d.resume_version == 100
    assert [x.rank for x in d.node_local] == [1] and [t.owner for t in d.transfers] == [2]


@pytest.mark.parametrize("img, field", [
    (_local(rank=0), "node_local.rank"),             # rank 0 is alive: its own worker has its image
    (_local(node="b"), "node_local.node_id"),        # rank 1 ran on node a
    (_local(rank=9), "node_local.rank"),             # outside the world
])
def test_inconsistent_node_local_facts_are_rejected(img: NodeLocalImage, field: str) -> None:
    with pytest.raises(ConfigError) as exc:
        replace(example_facts(), node_local=(img,))
    assert exc.value.field == field


def test_one_node_local_image_per_rank_and_sane_numbers() -> None:
    with pytest.raises(ConfigError, match="two node-local"):
        replace(example_facts(), node_local=(_local(), _local(version=99)))
    with pytest.raises(ConfigError):
        NodeLocalImage(1, "a", -1, 3)


# --- records: exit record, plan on the wire, facts from the view -------------------------------------------
def test_exit_record_carries_the_local_image_and_stays_backward_compatible() -> None:
    rec = ExitRecord(1, "a/w1", "a", 42, None, 9, 1.5, local_image=_local(node="a", version=5, n=3))
    back = ExitRecord.from_json(rec.to_json())
    assert back == rec and back.local_image == NodeLocalImage(1, "a", 5, 3, 7)
    doc = json.loads(rec.to_json())
    del doc["local_image"]  # an older agent's record
    assert ExitRecord.from_json(json.dumps(doc).encode()) == replace(rec, local_image=None)
    for bad in ({"version": -1, "n_chunks": 3}, {"n_chunks": 3}, [5, 3], "x"):
        doc["local_image"] = bad  # malformed: ignored, the exit itself still counts
        assert ExitRecord.from_json(json.dumps(doc).encode()) == replace(rec, local_image=None)


def test_plan_with_node_local_round_trips_and_old_plans_decode() -> None:
    d = plan_recovery(replace(example_facts(), node_local=(_local(),)))
    assert isinstance(d, RecoveryPlan) and d.node_local
    doc = json.loads(json.dumps(decision_to_doc(d)))
    assert decision_from_doc(doc) == d
    del doc["node_local"]
    assert decision_from_doc(doc) == replace(d, node_local=())


def test_leader_plans_from_the_current_workers_exit_record_only() -> None:
    w = SimWorld()
    w.kill(1)
    a = w.membership.worker_of(1)
    w.exits[1] = replace(w.exits[1], local_image=NodeLocalImage(1, a.node_id, w.committed, 3, 0))
    w.report_all_alive()
    d, notes = plan_from_view(w.view(), "job", frozenset({1}), 1, "ring", None)
    assert isinstance(d, RecoveryPlan) and [x.rank for x in d.node_local] == [1] and not d.transfers, (d, notes)
    # The record of an earlier incarnation says nothing about this worker: peers send it.
    w.exits[1] = replace(w.exits[1], worker_id="n0/older")
    d2, _ = plan_from_view(w.view(), "job", frozenset({1}), 1, "ring", None)
    assert isinstance(d2, RecoveryPlan) and not d2.node_local and [t.owner for t in d2.transfers] == [1]
    # An image said to be on another node than the rank ran on is not used, and said so.
    w.exits[1] = replace(w.exits[1], worker_id=a.worker_id, local_image=NodeLocalImage(1, "n1", w.committed, 3, 0))
    d3, notes3 = plan_from_view(w.view(), "job", frozenset({1}), 1, "ring", None)
    assert isinstance(d3, RecoveryPlan) and not d3.node_local and any("node-local" in n for n in notes3)


# --- the own-image files --------------------------------------------------------------------------------
def _image(version: int, nbytes: int = 50_000, rank: int = 1, seed: int = 0) -> tuple[Manifest, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * version + seed)
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return Manifest(JOB, rank, version, 2, nbytes, CHUNK, tuple(chunk_checksums(buf, CHUNK))), buf


def _commit(files: OwnImageFiles, version: int, **kw: int) -> tuple[Manifest, torch.Tensor, str | None]:
    m, data = _image(version, **kw)
    buf, path = files.allocate(m.total_bytes)
    buf[: m.total_bytes].copy_(data)
    files.publish(path, m)
    return m, data, path


def test_own_file_names_parse_and_are_removed_with_their_group(shm_dir: str) -> None:
    p = own_path(shm_dir, JOB, "node-a", 3, "0123abcd", 12, "json")
    f = parse_name(os.path.basename(p))
    assert f is not None and (f.kind, f.rank, f.token, f.index, f.owner, f.holder) == ("own_json", 3, "0123abcd", 12,
                                                                                        None, None)
    tmp = parse_name(os.path.basename(p) + ".tmp")
    assert tmp is not None and tmp.tmp and tmp.kind == "own_json"
    files = OwnImageFiles(shm_dir, JOB, "node-a", 3)
    _commit(files, 4, rank=3)
    assert {f.kind for f in own_files(shm_dir, JOB, "node-a", 3)} == {"own_bin", "own_json"}
    assert own_files(shm_dir, JOB, "node-b", 3) == [] and own_files(shm_dir, JOB, "node-a", 2) == []
    cleanup_job(shm_dir, JOB, only_node="node-a")
    assert list_files(shm_dir) == []


def test_newest_committed_image_is_found_verified_and_older_ones_retracted(shm_dir: str) -> None:
    files = OwnImageFiles(shm_dir, JOB, "n", 1)
    m1, _, p1 = _commit(files, 1)
    m2, data2, p2 = _commit(files, 2)
    files.retract(p1)  # what the engine does once v2 committed
    assert ownimage.newest_verified(shm_dir, JOB, "n", 1) == m2
    got_m, got = ownimage.open_verified(shm_dir, JOB, "n", 1, 2, len(m2.chunk_checksums), 2)
    assert got_m == m2 and torch.equal(got, data2)
    with pytest.raises(NodeLocalImageError):  # not what the plan named (another generation)
        ownimage.open_verified(shm_dir, JOB, "n", 1, 2, len(m2.chunk_checksums), 3)
    assert ownimage.newest_verified(shm_dir, JOB, "other-node", 1) is None
    assert ownimage.newest_verified(shm_dir, "another-job", "n", 1) is None
    assert ownimage.discard_newer(shm_dir, JOB, "n", 1, 1) and ownimage.newest_verified(shm_dir, JOB, "n", 1) is None


def test_a_flipped_byte_is_never_offered_and_the_older_intact_copy_is(shm_dir: str) -> None:
    files = OwnImageFiles(shm_dir, JOB, "n", 1)
    m1, _, _ = _commit(files, 1)
    m2, _, p2 = _commit(files, 2)  # a crash between publishing v2 and retracting v1: both tell the truth
    assert p2 is not None
    with open(p2, "r+b") as f:
        f.seek(m2.total_bytes // 2)
        b = f.read(1)
        f.seek(m2.total_bytes // 2)
        f.write(bytes([b[0] ^ 0x01]))
    assert ownimage.newest_verified(shm_dir, JOB, "n", 1) == m1
    with pytest.raises(IntegrityError, match="corrupt chunk"):
        ownimage.open_verified(shm_dir, JOB, "n", 1, 2, len(m2.chunk_checksums), 2)
    os.truncate(p2, 10)  # a short payload is refused, never mapped past its end
    with pytest.raises(NodeLocalImageError, match="manifest wants"):
        ownimage.open_verified(shm_dir, JOB, "n", 1, 2, len(m2.chunk_checksums), 2)
    m_other, _ = _image(3, rank=2)  # a manifest naming another rank beside rank 1's buffer
    with open(own_path(shm_dir, JOB, "n", 1, files.token, 99, "json"), "wb") as f:
        f.write(m_other.to_bytes())
    assert [c.manifest.version for c in ownimage.candidates(shm_dir, JOB, "n", 1)] == [2, 1]


def test_sweep_removes_what_older_engines_left_and_close_removes_its_own(shm_dir: str) -> None:
    old = OwnImageFiles(shm_dir, JOB, "n", 1)
    _commit(old, 1)
    neighbour = OwnImageFiles(shm_dir, JOB, "n", 2)
    _commit(neighbour, 1, rank=2)
    new = OwnImageFiles(shm_dir, JOB, "n", 1)
    m, _, _ = _commit(new, 2)
    assert len(new.sweep_others()) == 2 and new.sweep_others() == []  # once
    assert {f.token for f in own_files(shm_dir, JOB, "n", 1)} == {new.token}
    assert ownimage.newest_verified(shm_dir, JOB, "n", 1) == m
    new.close()
    assert own_files(shm_dir, JOB, "n", 1) == [] and len(own_files(shm_dir, JOB, "n", 2)) == 2


def test_full_shm_falls_back_to_memory_instead_of_sigbus(shm_dir: str, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    def full(fd: int, off: int, n: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    caplog.set_level("WARNING", logger="ckptless.mirror.shm")
    files = OwnImageFiles(shm_dir, JOB, "n", 1)
    buf, path = files.allocate(1 << 20)
    assert path is None and buf.numel() == 1 << 20 and "No space" in files.disabled_reason
    assert files.allocate(2 << 20)[1] is None  # a regrown buffer (a bigger version) too, without a second warning
    files.publish(path, _image(1)[0])  # a buffer in memory is never announced
    assert own_files(shm_dir, JOB, "n", 1) == []
    (msg,) = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert "rank 1" in msg and "ENOSPC" in msg and shm_dir in msg and f"{1 << 20} bytes" in msg, msg


# --- the respawn's restore ------------------------------------------------------------------------------
def _registry(seed: int) -> tuple[StateRegistry, torch.nn.Module]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 32)
    reg = StateRegistry(include_rng=False)
    reg.protect(model=model)
    return reg, model


def _restore_inputs(reg: StateRegistry, shm_dir: str) -> tuple[RestoreInputs, RecoveryPlan, Manifest]:
    """A world of 1 (no peers: the plan moves nothing over the network) whose rank 0 was respawned."""
    src, _ = _registry(1)
    img = Capturer(src, JOB, 0, CHUNK).capture(5, 2)
    files = OwnImageFiles(shm_dir, JOB, "n", 0)
    buf, path = files.allocate(img.manifest.total_bytes)
    buf[: img.manifest.total_bytes].copy_(img.buffer[: img.manifest.total_bytes])
    files.publish(path, img.manifest)
    a = Assignment(0, "n/respawn-g3-r0", "n", "respawn")
    plan = RecoveryPlan(JOB, 3, (a,), (0,), 5, (), (), True, (0,), 0,
                        node_local=(LocalRestore(0, a.worker_id, "n", 5, len(img.manifest.chunk_checksums), 2),))
    m = Membership(3, 1, "h", 1, (a,), plan)
    return RestoreInputs(m, a.worker_id, reg, [], None, 10.0, JOB, shm_dir=shm_dir, node_id="n"), plan, img.manifest


def test_respawn_restores_in_place_from_its_node_copy(shm_dir: str) -> None:
    reg, model = _registry(2)
    _, want = _registry(1)
    weight = model.weight
    inputs, plan, _ = _restore_inputs(reg, shm_dir)
    out = apply_decision(plan, inputs)
    assert (out.source, out.bytes_received, out.resume_step) == ("node-local", 0, 5)
    assert model.weight is weight, "restored into the live tensors"
    assert all(torch.equal(v, want.state_dict()[k]) for k, v in model.state_dict().items())


def test_respawn_refuses_a_copy_that_went_bad_after_the_agent_checked_it(shm_dir: str) -> None:
    reg, model = _registry(2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    inputs, plan, manifest = _restore_inputs(reg, shm_dir)
    (payload,) = [os.path.join(shm_dir, f.name) for f in own_files(shm_dir, JOB, "n", 0) if f.kind == "own_bin"]
    with open(payload, "r+b") as f:
        f.seek(manifest.total_bytes - 1)
        b = f.read(1)
        f.seek(manifest.total_bytes - 1)
        f.write(bytes([b[0] ^ 0x80]))
    with pytest.raises(IntegrityError):  # the worker turns this into RestoreFailed: re-planned from peers
        apply_decision(plan, inputs)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items()), "nothing restored from it"
    shutil.rmtree(shm_dir)
    os.makedirs(shm_dir)
    with pytest.raises(NodeLocalImageError, match="no node-local own image"):
        apply_decision(plan, inputs)
    with pytest.raises(NodeLocalImageError, match="no shm dir"):
        apply_decision(plan, replace(inputs, shm_dir=None))



# --- a real engine: the manifest follows the committed buffer -------------------------------------------
def _engine_worker(rank: int, world: int, tmp: str, shm_dir: str, pool: int, rounds: int) -> None:
    import signal
    import traceback

    import torch.distributed as dist

    from ckptless.mirror import MirrorConfig, MirrorEngine

    out: dict[str, object] = {"obs": [], "error": None}
    obs: list[list[object]] = []
    try:
        init_gloo(rank, world, os.path.join(tmp, "store"))
        cfg = MirrorConfig.build(replicas=1, chunk_bytes=CHUNK, wire_bytes=4 * CHUNK, timeout_s=30.0,
                                 shm_dir=shm_dir, pool_buffers=pool)
        eng = MirrorEngine(dist.new_group(backend="gloo"), JOB, cfg, generation=2, node_of=["host"] * world)

        def committed() -> list[int]:
            return [c.manifest.version for c in ownimage.candidates(shm_dir, JOB, "host", rank)]

        for v in range(1, rounds + 1):
            m, data = _image(v, nbytes=20_000 + 4096 * v, rank=rank)  # grows: buffers are regrown too
            b = eng.acquire_buffer(m.total_bytes, timeout=30)
            obs.append(["acquired", v, committed()])
            b[: m.total_bytes].copy_(data)
            eng.submit(m, b)
            eng.wait_idle(30)
            newest = ownimage.newest_verified(shm_dir, JOB, "host", rank)
            obs.append(["committed", v, committed(), None if newest is None else newest.version])
        out["obs"] = obs
        out["committed"] = eng.committed_version
    except Exception:
        out["error"] = traceback.format_exc()
    with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # its committed image must outlive it
    eng.close()
    os._exit(0)


@pytest.mark.parametrize("pool", [1, 2])
def test_engine_keeps_exactly_the_committed_image_in_shm_and_it_outlives_sigkill(tmp_path: Path, shm_dir: str,
                                                                                 pool: int) -> None:
    world, rounds = 2, 6
    procs = start_and_join(_engine_worker, [(r, world, str(tmp_path), shm_dir, pool, rounds) for r in range(world)])
    for r in range(world):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["error"] is None, res["error"]
        assert res["committed"] == rounds
        for kind, v, *rest in res["obs"]:
            if kind == "committed":  # one manifest, the committed version's, and it verifies
                assert rest == [[v], v], (pool, res["obs"])
            elif v > 1:  # capturing v: with one buffer the committed copy is given up first
                assert rest == ([[]] if pool == 1 else [[v - 1]]), (pool, res["obs"])
    assert procs[0].exitcode == -9 and procs[1].exitcode == 0
    m = ownimage.newest_verified(shm_dir, JOB, "host", 0)
    assert m is not None and m.version == rounds
    got_m, got = ownimage.open_verified(shm_dir, JOB, "host", 0, rounds, len(m.chunk_checksums), m.generation)
    assert torch.equal(got, _image(rounds, nbytes=20_000 + 4096 * rounds, rank=0)[1])
    assert own_files(shm_dir, JOB, "host", 1) == [], "a clean close removes the engine's own files"
    assert sorted(f.kind for f in own_files(shm_dir, JOB, "host", 0)) == ["own_bin"] * pool + ["own_json"]


# --- R11 (issue 35): another process reads a dead holder's replicas and a dead rank's own image ------------
def _held_replica(shm_dir: str, holder: int, owner: int, version: int, seed: int = 0):
    from ckptless.mirror.store import PeerStore

    store = PeerStore(JOB, 0, shm_dir, holder=holder, node="n")
    m, data = _image(version, rank=owner, seed=seed)
    store.put(m, data)
    return store, m, data


def test_a_dead_holders_replicas_are_reported_checked_and_adopted_by_another_process(shm_dir: str) -> None:
    from ckptless.mirror.reattach import open_copy, verified_copies
    from ckptless.mirror.store import PeerStore
    from ckptless.recovery.decision import Adoption
    from ckptless.recovery.executor import adopt_copies

    store, m, data = _held_replica(shm_dir, holder=1, owner=2, version=7)
    store.put(*_image(8, rank=2))  # the other slot: the newer version
    del store  # the holder dies: its files stay
    assert [(x.owner, x.version) for x in verified_copies(shm_dir, JOB, "n", 1)] == [(2, 7), (2, 8)]
    assert verified_copies(shm_dir, JOB, "n", 3) == [] and verified_copies(shm_dir, JOB, "other", 1) == []
    got, held = open_copy(shm_dir, JOB, "n", 1, 2, 7, m.generation, len(m.chunk_checksums))
    assert got == m and torch.equal(held, data)
    with pytest.raises(IntegrityError, match="no replica"):
        open_copy(shm_dir, JOB, "n", 1, 2, 7, m.generation + 1, len(m.chunk_checksums))
    # rank 0 on the same node adopts it (its own store is another holder's files), and then holds it
    mine = PeerStore(JOB, 3, shm_dir, holder=0, node="n")  # at a later generation: no ordering check
    plan = RecoveryPlan("j", 4, (), (), 7, (), (), False, (), 0,
                        adoptions=(Adoption("n/w0", 2, 1, "n", 7, len(m.chunk_checksums), m.generation),))
    assert adopt_copies(plan, "n/w0", mine, shm_dir, JOB, "n") == 1
    assert adopt_copies(plan, "n/w0", mine, shm_dir, JOB, "n") == 0, "idempotent"
    img = mine.get(2, 7)
    assert img is not None and img.manifest == m and torch.equal(img.buffer, data)
    assert [(x.owner, x.version) for x in verified_copies(shm_dir, JOB, "n", 0)] == [(2, 7)], \
        "in its own files: it outlives this process too"
    # a flipped byte in the dead holder's file: neither reported nor adopted
    (path,) = [os.path.join(shm_dir, f.name) for f in list_files(shm_dir)
               if f.holder == 1 and f.kind == "bin" and f.owner == 2 and
               os.path.exists(os.path.join(shm_dir, f.name[:-4] + ".json")) and
               json.load(open(os.path.join(shm_dir, f.name[:-4] + ".json")))["version"] == 8]
    with open(path, "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 1]))
    assert [(x.owner, x.version) for x in verified_copies(shm_dir, JOB, "n", 1)] == [(2, 7)]
    with pytest.raises(IntegrityError):
        open_copy(shm_dir, JOB, "n", 1, 2, 8, m.generation, len(m.chunk_checksums))


def test_a_dead_ranks_own_image_is_adopted_as_a_replica(shm_dir: str) -> None:
    from ckptless.mirror.store import PeerStore
    from ckptless.recovery.decision import Adoption
    from ckptless.recovery.executor import adopt_copies

    files = OwnImageFiles(shm_dir, JOB, "n", 3)
    m, data, _ = _commit(files, 5, rank=3)
    mine = PeerStore(JOB, 0, None)
    plan = RecoveryPlan("j", 4, (), (), 5, (), (), False, (), 0,
                        adoptions=(Adoption("n/w2", 3, 3, "n", 5, len(m.chunk_checksums), m.generation),))
    with pytest.raises(IntegrityError, match="no node-local tier"):
        adopt_copies(plan, "n/w2", mine, None, JOB, "n")
    assert adopt_copies(plan, "n/w2", mine, shm_dir, JOB, "n") == 1
    img = mine.get(3, 5)
    assert img is not None and img.manifest == m and torch.equal(img.buffer, data)
    assert adopt_copies(plan, "n/w1", mine, shm_dir, JOB, "n") == 0, "only this worker's adoptions"
