"""Which GPU each worker of a node uses (launcher/devices.py, the slot table), and what the agent records
when a worker's GPU fails (launcher/exit_records.py). Pure: no process, no etcd, no GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckptless.environment import ProcessEnv
from ckptless.errors import ConfigError
from ckptless.launcher import devices, refill, respawn
from ckptless.launcher.args import parse_args
from ckptless.launcher.exit_records import record_exit
from ckptless.launcher.node_state import NodeState
from ckptless.launcher.slots import Slot, SlotTable
from ckptless.launcher.worker_process import WorkerExit
from ckptless.recovery.decision import Assignment
from ckptless.recovery.view import ExitRecord


def _count_never() -> int:
    raise AssertionError("the driver must not be asked when a variable says how many GPUs there are")


# --- how many GPUs --------------------------------------------------------------------------------------------
def test_node_gpus_override_then_visible_devices_then_the_driver() -> None:
    env = ProcessEnv.from_mapping({"CKPTLESS_NODE_GPUS": "0"})
    assert devices.node_gpus(env, {"CUDA_VISIBLE_DEVICES": "0,1"}, _count_never) == (0, "CKPTLESS_NODE_GPUS")
    plain = ProcessEnv()
    assert devices.node_gpus(plain, {"CUDA_VISIBLE_DEVICES": "4, 6,GPU-1a2b"}, _count_never) == (
        3, "CUDA_VISIBLE_DEVICES")
    assert devices.node_gpus(plain, {"CUDA_VISIBLE_DEVICES": ""}, _count_never)[0] == 0
    assert devices.node_gpus(plain, {"CUDA_VISIBLE_DEVICES": "2,-1,3"}, _count_never)[0] == 1  # CUDA stops at -1
    assert devices.node_gpus(plain, {}, lambda: 8) == (8, "torch.cuda.device_count()")
    assert devices.node_gpus(plain, {})[0] == 0  # this machine: torch's CPU build counts none
    with pytest.raises(ConfigError, match="CKPTLESS_NODE_GPUS"):
        ProcessEnv.from_mapping({"CKPTLESS_NODE_GPUS": "-2"})


# --- the start: members on their local rank, spares on free GPUs, or one clear refusal --------------------------
def test_members_keep_torchruns_gpu_and_spares_take_the_free_ones() -> None:
    assert devices.initial_gpus(4, 2, 2) == [0, 1, 2, 3]
    assert devices.initial_gpus(8, 0, 3) == [0, 1, 2]  # a spare node
    assert devices.initial_gpus(2, 4, 0) == [0, 1, None, None]  # oversubscribed, no spares: as before
    assert devices.initial_gpus(0, 2, 2) == [None] * 4  # a CPU job


def test_spares_without_a_gpu_of_their_own_are_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as exc:
        devices.check_spares(8, "CUDA_VISIBLE_DEVICES", 8, 1)
    text = str(exc.value)
    assert exc.value.field == "spares" and exc.value.value == 1 and "\n" not in text
    for needle in ("--spares 1", "needs 9 GPUs", "has 8 (CUDA_VISIBLE_DEVICES)", "--nproc-per-node 0 --spares N",
                   "CKPTLESS_NODE_GPUS=0"):
        assert needle in text, (needle, text)
    devices.check_spares(8, "x", 6, 2)  # fits
    devices.check_spares(0, "x", 8, 4)  # a CPU job: spares as before
    devices.check_spares(4, "x", 8, 0)  # no spares: an oversubscribed node is the script's business


def test_choose_gpu_keeps_its_own_unless_bad_or_taken() -> None:
    assert devices.choose_gpu(4, used={0, 1}, bad=(), keep=3) == 3
    assert devices.choose_gpu(4, used={0, 1}, bad={3}, keep=3) == 2
    assert devices.choose_gpu(4, used={0, 1, 3}, bad=(), keep=3) == 2  # a live worker uses it now
    assert devices.choose_gpu(4, used={0, 1}, bad={2, 3}, keep=3) is None


# --- the environment that puts a worker on its GPU ----------------------------------------------------------
def test_a_spares_env_names_its_own_gpu_plain_and_virtual() -> None:
    assert devices.spare_device_env(2, 2, False, {}) == {"LOCAL_RANK": "2"}
    assert devices.spare_device_env(9, 3, False, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}) == {
        "LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}  # a valid ordinal of what it sees
    assert devices.spare_device_env(9, 3, True, {"CUDA_VISIBLE_DEVICES": "4,5,6, 7"}) == {
        "LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "7"}  # mapped through the agent's list
    assert devices.spare_device_env(9, 3, True, {}) == {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "3"}
    with pytest.raises(ConfigError, match="no entry for GPU 3"):
        devices.spare_device_env(9, 3, True, {"CUDA_VISIBLE_DEVICES": "4,5"})
    # a CPU job: LOCAL_RANK is its slot, as always; virtual: no GPU, said plainly (never CUDA_VISIBLE_DEVICES=9)
    assert devices.spare_device_env(9, None, False, {}) == {"LOCAL_RANK": "9"}
    assert devices.spare_device_env(9, None, True, {}) == {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": ""}
    env = refill.spare_env("n/spare1", "hb", "exit", 3, devices.spare_device_env(3, 3, True, {}))
    assert env["LOCAL_RANK"] == "0" and env["CUDA_VISIBLE_DEVICES"] == "3" and env["CKPTLESS_STANDBY_RANK"] == "3"


# --- the slot table: respawns, failures, refills -------------------------------------------------------------
def _table(gpus: int, members: int, spares: int) -> SlotTable:
    t = SlotTable(gpus)
    gpu = devices.initial_gpus(gpus, members, spares)
    for lr in range(members + spares):
        t.add(Slot(lr, f"n/w{lr}", lr if lr < members else None, f"hb{lr}", device=gpu[lr]))
    return t


def test_a_respawn_keeps_its_gpu_and_moves_only_off_a_bad_one() -> None:
    t = _table(4, 2, 0)  # GPUs 2 and 3 free
    t.exited(1, ok=False)
    assert t.claim_device(1) == (True, 1)  # a plain crash: the same GPU
    assert t.device_failed(1) == (1, True)  # its GPU failed: marked bad, the slot moves to GPU 2 at once
    assert t.bad_gpus() == {1} and t.get(1).device == 2
    assert t.claim_device(1) == (True, 2)
    t.reset(1, "n/r1", 1)
    t.exited(1, ok=False)
    assert t.device_failed(1) == (2, True) and t.get(1).device == 3
    t.reset(1, "n/r2", 1)
    t.exited(1, ok=False)
    assert t.device_failed(1) == (3, False)  # no good GPU left: not started again here
    assert t.claim_device(1) == (False, None)


def test_two_failures_never_count_the_same_free_gpu() -> None:
    t = _table(3, 2, 0)  # one free GPU (2)
    t.exited(0, ok=False)
    t.exited(1, ok=False)
    assert t.device_failed(0) == (0, True) and t.get(0).device == 2
    assert t.device_failed(1) == (1, False)


def test_a_cpu_job_has_no_gpu_to_choose_and_a_gpu_failure_there_stays_off_the_node() -> None:
    t = _table(0, 2, 1)
    t.exited(1, ok=False)
    assert t.claim_device(1) == (True, None) and t.gpu_free()
    assert t.device_failed(1) == (None, False)


def test_a_refill_takes_the_gpu_a_dead_worker_freed_and_none_when_all_are_taken_or_bad() -> None:
    t = _table(4, 2, 2)  # full node: members on 0-1, spares on 2-3
    assert not t.gpu_free()
    assert not t.add_with_device(Slot(4, "n/spare2", None, "hb4"))
    t.exited(1, ok=False)  # rank 1's worker died on GPU 1 ...
    assert not t.gpu_free()  # ... which stays its own until a membership says where rank 1 goes
    t.assign(2, 1)  # the spare in slot 2 took rank 1
    t.assign(1, None)
    assert t.gpu_free()
    new = Slot(4, "n/spare2", None, "hb4")
    assert t.add_with_device(new) and new.device == 1 and t.get(4).spare
    assert not t.gpu_free()
    t2 = _table(4, 2, 2)
    t2.exited(1, ok=False)
    assert t2.device_failed(1) == (1, False)  # a bad GPU is never refilled onto
    assert not t2.gpu_free()


# --- the agent: a GPU-class exit marks the GPU bad and says whether the rank can start here again ------------
class _Outbox:
    def __init__(self) -> None:
        self.puts: dict[str, bytes] = {}

    def put(self, key: str, value: bytes | object, what: str) -> None:
        self.puts[key] = value() if callable(value) else value  # type: ignore[assignment]

    def delete(self, key: str, what: str) -> None:
        self.puts.pop(key, None)


def _node(tmp_path: Path, gpus: int, members: int, spares: int) -> tuple[NodeState, _Outbox]:
    cfg = parse_args(["--nproc-per-node", str(members), "--spares", str(spares), "--no-shm-dir", "x.py"], {})
    st = NodeState(cfg, "n", str(tmp_path), gpus)
    gpu = devices.initial_gpus(gpus, members, spares)
    for lr in range(members + spares):
        st.slots.add(Slot(lr, f"n/w{lr}", lr if lr < members else None, st.heartbeat_path(lr), device=gpu[lr]))
    box = _Outbox()
    st.outbox = box  # type: ignore[assignment]
    return st, box


def _device_exit(st: NodeState, lr: int, pid: int) -> None:
    Path(st.exit_path(lr)).write_text(json.dumps({"kind": "device", "pid": pid, "error": {
        "type": "AcceleratorError", "message": "CUDA error: uncorrectable ECC error encountered "
                                               "(cudaErrorECCUncorrectable, 214)", "traceback": "..."}}))
    record_exit(st, WorkerExit(lr, pid, 0, 1, None, 0.0, 1.0, False))


def test_the_agent_marks_the_gpu_bad_and_records_whether_its_rank_can_start_here(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    st, box = _node(tmp_path, 3, 2, 0)  # GPU 2 free
    _device_exit(st, 1, pid=41)
    rec = ExitRecord.from_json(box.puts[st.keyspace.worker_exit(1)])
    assert rec.kind == "device" and rec.outcome == "fault" and rec.respawnable
    assert st.slots.bad_gpus() == {1} and st.slots.get(1).device == 2
    assert [r.getMessage() for r in caplog.records if "GPU 1 is marked bad" in r.getMessage()], caplog.text
    assert "uncorrectable ECC" in caplog.text
    _device_exit(st, 0, pid=40)  # the next failure finds no good GPU left
    rec0 = ExitRecord.from_json(box.puts[st.keyspace.worker_exit(0)])
    assert not rec0.respawnable and st.slots.bad_gpus() == {0, 1}


def test_a_plain_crash_leaves_the_gpus_alone(tmp_path: Path) -> None:
    st, box = _node(tmp_path, 2, 2, 0)
    record_exit(st, WorkerExit(1, 41, 0, None, 9, 0.0, 1.0, False))
    rec = ExitRecord.from_json(box.puts[st.keyspace.worker_exit(1)])
    assert rec.respawnable and rec.kind is None and not st.slots.bad_gpus()


def test_a_respawn_is_put_on_its_gpu_and_one_with_no_gpu_left_is_recorded_at_once(tmp_path: Path) -> None:
    st, box = _node(tmp_path, 2, 2, 0)
    assert st.respawn_device_env(None) == {}  # a CPU job (or an oversubscribed rank): LOCAL_RANK as it was
    assert st.respawn_device_env(1) == {"LOCAL_RANK": "1"}
    _device_exit(st, 1, pid=41)  # GPU 1 fails; GPU 0 is rank 0's: nothing left for rank 1 here
    respawn.start(st, None, 1, Assignment(1, "n/respawn-g1-r1", "n", "respawn"), 1)  # type: ignore[arg-type]
    rec = ExitRecord.from_json(box.puts[st.keyspace.worker_exit(1)])
    assert (rec.worker_id, rec.pid, rec.kind, rec.respawnable) == ("n/respawn-g1-r1", -1, "device", False)
    assert rec.outcome == "fault" and "no free good GPU" in rec.describe() and not st.slots.get(1).alive


@pytest.mark.parametrize("backend", [None, "none", "gloo"])
def test_a_corrupt_rank_on_a_node_without_gpus_says_why_none_is_marked_truthfully(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, backend: str | None) -> None:
    """Issue 35 (a review): the warning said "a CPU node" even on a GPU job whose agent assigns no GPU
    (a CUDA backend set, none counted): there it names that, not a CPU node. Either way the rank may
    start again here, and nothing says its GPU failed."""
    from ckptless import environment

    monkeypatch.setattr(environment, "_current", ProcessEnv.from_mapping(
        {} if backend is None else {"CKPTLESS_CUDA_BACKEND": backend}))
    st, box = _node(tmp_path, 0, 2, 0)
    Path(st.exit_path(1)).write_text(json.dumps({"kind": "device", "pid": 41, "error": {
        "type": "SilentDataCorruption", "message": "silent data corruption at step 5: rank 1 is the odd one",
        "traceback": ""}}))
    record_exit(st, WorkerExit(1, 41, 0, 1, None, 0.0, 1.0, False))
    rec = ExitRecord.from_json(box.puts[st.keyspace.worker_exit(1)])
    assert rec.respawnable
    line = next(r.getMessage() for r in caplog.records if "left as failed hardware" in r.getMessage())
    assert "GPU failed" not in line and "may start again here" in line, line
    if backend == "gloo":
        assert "CPU node" not in line and "assigns no GPU" in line and "gloo" in line, line
    else:
        assert "a CPU node has no GPU to mark bad" in line, line
