"""The ported examples survive real SIGKILLs: DDP (default, gradient_as_bucket_view) and FSDP2.

Real etcd, the real launcher (2 agents x 2 workers: world 4, K = 1), the real
example scripts (examples/ddp_train.py, examples/fsdp2_train.py) and a real
SIGKILL at an exact point: the victim announces OUT/paused_rank<R>.json when
about to run step S (or inside that step's backward, while its peers already
sit in DDP's all-reduce / FSDP2's reduce-scatter) and holds there until the
test kills it. Verdict: every rank's final parameters, optimizer state, LR,
RNG draws and data position are ``torch.equal`` to the fault-free run's; the
survivors kept their processes and the victim's rank was taken over by a new
one. The user's DDP / FSDP2 objects are built once by the script and never
re-wrapped.

Also: what a script that still calls ``init_process_group`` after
``ckptless.init()`` gets (the guarded idiom works; an unconditional call fails
fast as a user error, named in the log, without respawns).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ckptless.coordinator.embedded import EmbeddedEtcd
from ckptless.coordinator.keyspace import Keyspace

from ..harness import nccl_like
from ..harness.cluster import Cluster, assert_bitwise_equal, descendants_with_env, independent_pair, wait_exit, wait_membership
from ..harness.repo import PYTHON, REPO, SCRIPTS, child_env
from ..harness.waiting import wait_until

DDP_SCRIPT = str(REPO / "examples" / "ddp_train.py")
FSDP_SCRIPT = str(REPO / "examples" / "fsdp2_train.py")
INIT_PG_SCRIPT = str(SCRIPTS / "ddp_init_pg.py")
STEPS = 12  # 16 batches per rank and epoch; DDP rebuilds its buckets at step 1
WORLD = 4


@dataclass
class ExampleCluster(Cluster):
    """A Cluster running an example script (``--out OUT --steps STEPS`` plus ``script_args``)."""

    script: str = DDP_SCRIPT
    script_args: tuple[str, ...] = ()
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    def start_agent(self, *extra: str, nproc: int = 2) -> subprocess.Popen[str]:  # type: ignore[override]
        env = child_env()
        env.update({"CKPTLESS_LOG_LEVEL": "INFO", "CKPTLESS_COLLECTIVE_TIMEOUT": "30",
                    "CKPTLESS_RECOVERY_TIMEOUT": "60"})
        env.update(self.env)
        log = self.out / f"agent{len(self.agents)}.log"
        self.logs.append(log)
        proc = subprocess.Popen(
            [PYTHON, "-m", "ckptless.launcher.main", "--nnodes", "2", "--nproc-per-node", str(nproc),
             "--rdzv-id", self.job_id, "--rdzv-endpoint", self.endpoint, "--lease-ttl", "1", *extra,
             self.script, "--out", str(self.out), "--steps", str(STEPS), *self.script_args],
            env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        self.agents.append(proc)
        return proc

    def worker_pids(self) -> dict[int, int]:
        """rank -> pid of the live worker launched for it (from /proc: RANK in its environment)."""
        found: dict[int, int] = {}
        for r in range(WORLD):
            for a in self.agents:
                pids = descendants_with_env(a.pid, "RANK", str(r))
                if pids:
                    found[r] = min(pids)  # the worker itself (its children, e.g. loader workers, come later)
        return found

    def finals_with_pids(self) -> tuple[dict[int, dict[str, object]], dict[int, int]]:
        finals = self.finals(WORLD)
        pids = {r: int(f.pop("pid")) for r, f in finals.items()}  # type: ignore[call-overload]
        return finals, pids


def _run(etcd: EmbeddedEtcd, out: Path, script: str, args: Sequence[str] = (), **env: str) -> ExampleCluster:
    out.mkdir(parents=True, exist_ok=True)
    name = out.name
    return ExampleCluster(etcd.endpoint, out, f"{name}-{uuid.uuid4().hex[:6]}", env=dict(env), script=script,
                          script_args=tuple(args))


def _baseline(etcd: EmbeddedEtcd, root: Path, script: str, args: Sequence[str] = ()) -> dict[int, dict[str, object]]:
    c = _run(etcd, root / "base", script, args)
    try:
        c.start_agent()
        c.start_agent()
        c.wait()
    finally:
        c.kill_all()
    finals, _ = c.finals_with_pids()
    assert all(int(f["recoveries"]) == 0 for f in finals.values())  # type: ignore[call-overload]
    return finals


@pytest.fixture(scope="module")
def ddp_baseline(module_etcd: EmbeddedEtcd, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, object]]:
    """Fault-free DDP run with default arguments. gradient_as_bucket_view=True computes the very same
    numbers (the gradients are views into the same buckets, reduced the same way), so both variants
    are held to this one baseline."""
    return _baseline(module_etcd, tmp_path_factory.mktemp("ddp"), DDP_SCRIPT)


@pytest.fixture(scope="module")
def fsdp_baseline(module_etcd: EmbeddedEtcd, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, object]]:
    return _baseline(module_etcd, tmp_path_factory.mktemp("fsdp"), FSDP_SCRIPT)


def _kill_and_check(etcd: EmbeddedEtcd, out: Path, script: str, args: Sequence[str], victim: int, step: int,
                    where: str, baseline: dict[int, dict[str, object]], agent_args: Sequence[str] = (),
                    bitwise: bool = True, env: dict[str, str] | None = None) -> ExampleCluster:
    c = _run(etcd, out, script, args, EXAMPLE_PAUSE=f"{victim}:{step}:{where}", **(env or {}))
    try:
        c.start_agent(*agent_args)
        c.start_agent(*agent_args)
        doomed = c.paused_pid(victim)
        before = c.worker_pids()
        assert before.get(victim) == doomed, f"paused pid {doomed} is not rank {victim}'s worker: {before}"
        os.kill(doomed, signal.SIGKILL)
        c.wait()
    finally:
        c.kill_all()
    finals, pids = c.finals_with_pids()
    if bitwise:
        assert_bitwise_equal(finals, baseline)
    paused = json.loads((out / f"paused_rank{victim}.json").read_text())
    assert paused == {"pid": doomed, "step": step, "where": where}
    assert pids[victim] != doomed, "the victim's rank finished in the killed process"
    for r in range(WORLD):
        if r != victim:
            assert pids[r] == before[r], f"survivor rank {r} was restarted ({before[r]} -> {pids[r]})"
            assert int(finals[r]["recoveries"]) == 1, f"rank {r}: {finals[r]['recoveries']} recoveries"  # type: ignore[call-overload]
    return c


# --- DDP -------------------------------------------------------------------------------------------


def test_ddp_default_kill_survivor_side_rank_in_backward(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                                          ddp_baseline: dict) -> None:
    """Rank 3 dies inside step 5's backward: ranks 0-2 are in the reducer's all-reduce with it.

    Without the node-local tier (``--no-shm-dir``) its respawn rebuilds its image over the network:
    the DDP parameters and AdamW state (the replicated prefix, issue 21) from the live replicas' own
    images, only the rest (buffers, RNG, data position, reducer state) from its mirror holder, which
    never received the prefix."""
    c = _kill_and_check(module_etcd, tmp_path / "ddp_r3_bwd", DDP_SCRIPT, (), 3, 5, "backward", ddp_baseline,
                        agent_args=("--no-shm-dir",))
    got = re.search(r"rank 3: resumed at step \d+ in generation 1 \(peers: (\d+) bytes from holders, "
                    r"(\d+) from live replicas\)", c.log_text())
    assert got is not None, c.log_text()[-3000:]
    from_holders, from_replicas = int(got.group(1)), int(got.group(2))
    assert from_replicas > 0 and from_holders < from_replicas, (from_holders, from_replicas)


@pytest.mark.slow  # CI budget: CI kills DDP (default) and FSDP2; this variant runs in the slow tier
def test_ddp_bucket_view_kill_rank0_in_backward(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                                ddp_baseline: dict) -> None:
    """gradient_as_bucket_view=True; rank 0 (the rank whose bucket order DDP broadcasts) dies in backward."""
    _kill_and_check(module_etcd, tmp_path / "ddpbv_r0_bwd", DDP_SCRIPT, ("--bucket-view",), 0, 5, "backward",
                    ddp_baseline)


@pytest.mark.slow
def test_ddp_default_kill_rank0_at_step_start(module_etcd: EmbeddedEtcd, tmp_path: Path, ddp_baseline: dict) -> None:
    _kill_and_check(module_etcd, tmp_path / "ddp_r0_start", DDP_SCRIPT, (), 0, 6, "start", ddp_baseline)


@pytest.mark.slow
def test_ddp_bucket_view_kill_survivor_side_rank(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                                 ddp_baseline: dict) -> None:
    _kill_and_check(module_etcd, tmp_path / "ddpbv_r3_start", DDP_SCRIPT, ("--bucket-view",), 3, 4, "start",
                    ddp_baseline)


@pytest.mark.slow
def test_ddp_kill_while_buckets_are_rebuilt(module_etcd: EmbeddedEtcd, tmp_path: Path, ddp_baseline: dict) -> None:
    """Step 1 is where DDP rebuilds its buckets from rank 0's first-backward order (a broadcast)."""
    _kill_and_check(module_etcd, tmp_path / "ddp_r0_s1", DDP_SCRIPT, (), 0, 1, "backward", ddp_baseline)


@pytest.mark.slow
def test_ddp_plain_shuffled_dataloader(module_etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    """A plain ``DataLoader(shuffle=True)`` protected with the one-line ``resumable`` helper."""
    baseline = _baseline(module_etcd, tmp_path / "shuffle", DDP_SCRIPT, ("--loader", "shuffle"))
    _kill_and_check(module_etcd, tmp_path / "shuffle_r2", DDP_SCRIPT, ("--loader", "shuffle"), 2, 7, "backward",
                    baseline)


# --- FSDP2 -----------------------------------------------------------------------------------------


@pytest.mark.slow  # CI budget: CI kills FSDP2's rank 0 in backward on the NCCL-semantics backend (below)
def test_fsdp2_kill_rank0_in_backward(module_etcd: EmbeddedEtcd, tmp_path: Path, fsdp_baseline: dict) -> None:
    """Rank 0 dies inside step 5's backward, its peers in the last block's reduce-scatter."""
    _kill_and_check(module_etcd, tmp_path / "fsdp_r0_bwd", FSDP_SCRIPT, (), 0, 5, "backward", fsdp_baseline)


@pytest.mark.slow
def test_fsdp2_kill_survivor_side_rank(module_etcd: EmbeddedEtcd, tmp_path: Path, fsdp_baseline: dict) -> None:
    """Rank 3 (holding an empty shard of the head) dies at the start of step 4."""
    _kill_and_check(module_etcd, tmp_path / "fsdp_r3_start", FSDP_SCRIPT, (), 3, 4, "start", fsdp_baseline)


@pytest.mark.slow
def test_fsdp2_kill_survivor_side_rank_in_backward(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                                   fsdp_baseline: dict) -> None:
    _kill_and_check(module_etcd, tmp_path / "fsdp_r2_bwd", FSDP_SCRIPT, (), 2, 8, "backward", fsdp_baseline)


# --- init_process_group in a ported script ---------------------------------------------------------


def _init_pg_job(etcd: EmbeddedEtcd, out: Path, *mode: str) -> tuple[int, str]:
    out.mkdir(parents=True)
    env = child_env()
    env.update({"CKPTLESS_COLLECTIVE_TIMEOUT": "30", "CKPTLESS_RECOVERY_TIMEOUT": "60"})
    log = out / "agent.log"
    proc = subprocess.Popen(
        [PYTHON, "-m", "ckptless.launcher.main", "--nnodes", "1", "--nproc-per-node", "2",
         "--rdzv-id", f"initpg-{uuid.uuid4().hex[:6]}", "--rdzv-endpoint", etcd.endpoint, "--lease-ttl", "1",
         INIT_PG_SCRIPT, str(out), *mode],
        env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    code = wait_exit(proc, 180, f"the {' '.join(mode)} init_process_group job")
    return code, log.read_text(errors="replace")


def _failed_fast_as_user_error(code: int, log: str, out: Path) -> None:
    assert code == 1, log[-4000:]
    assert not list(out.glob("ok_rank*.json"))
    assert "a user error" in log and "not restarted" in log, log[-4000:]
    assert "respawning" not in log, log[-4000:]


def test_init_process_group_after_ckptless_init(module_etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    """The guarded idiom (``if not dist.is_initialized(): init_process_group(...)``) is a no-op and the
    job trains, also keeping ``destroy_process_group()`` after ``job.close()``. An unconditional second
    call raises ckptless's ``ConfigError`` saying to remove or guard it: the job fails fast as a user
    error (exit 1, no respawn) with that traceback in the launcher's summary (the exception escaped
    the script's setup, outside run(): the library records it all the same)."""
    code, log = _init_pg_job(module_etcd, tmp_path / "guarded", "guarded", "destroy")
    assert code == 0, log[-4000:]
    for r in range(2):
        ok = json.loads((tmp_path / "guarded" / f"ok_rank{r}.json").read_text())
        assert ok["world"] == 2

    code, log = _init_pg_job(module_etcd, tmp_path / "always", "always")
    if code == 0:  # accepted (a library that tolerates the call): the job must have trained normally
        assert len(list((tmp_path / "always").glob("ok_rank*.json"))) == 2, log[-4000:]
        return
    _failed_fast_as_user_error(code, log, tmp_path / "always")
    assert "init_process_group" in log and "ckptless.init() already created" in log, log[-4000:]
    assert "left no error record" not in log and "ConfigError" in log, log[-4000:]


@pytest.mark.slow
def test_init_process_group_before_ckptless_init(module_etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    """The plain script's call left in place, before ``ckptless.init()``: a ConfigError that says to remove it."""
    code, log = _init_pg_job(module_etcd, tmp_path / "before", "before")
    _failed_fast_as_user_error(code, log, tmp_path / "before")
    assert "ConfigError" in log and "remove the script's own init_process_group call" in log, log[-4000:]


# --- docs/porting.md: the diffs are real --------------------------------------------------------------

PORTING = REPO / "docs" / "porting.md"
EXAMPLE_OF = {"ddp": DDP_SCRIPT, "fsdp": FSDP_SCRIPT, "trainer": str(REPO / "examples" / "ddp_trainer.py"),
              "gpt": str(REPO / "examples" / "gpt_trainer.py"), "prefetch": str(REPO / "examples" / "prefetch_train.py"),
              "torchtitan": str(REPO / "examples" / "torchtitan_train.py")}


def _porting_block(kind: str, what: str) -> str:
    """The fenced block after ``<!-- porting-check: KIND WHAT -->`` in docs/porting.md."""
    m = re.search(rf"<!-- porting-check: {kind} {what} -->\n```\w+\n(.*?)^```$", PORTING.read_text(), re.S | re.M)
    assert m is not None, f"docs/porting.md has no {kind} {what} block"
    return m.group(1)


def _apply_unified_diff(original: str, diff: str) -> str:
    """Apply a one-file unified diff strictly: every context and removed line must match exactly."""
    src, out, pos = original.splitlines(keepends=True), [], 0
    lines = diff.splitlines(keepends=True)
    assert lines[0].startswith("--- ") and lines[1].startswith("+++ "), "not a unified diff"
    i = 2
    while i < len(lines):
        m = re.match(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@", lines[i])
        assert m is not None, f"bad hunk header: {lines[i]!r}"
        start = int(m.group(1)) - 1 if m.group(2) != "0" else int(m.group(1))
        assert start >= pos, "hunks out of order"
        out += src[pos:start]
        pos = start
        i += 1
        while i < len(lines) and not lines[i].startswith("@@"):
            tag, text = lines[i][0], lines[i][1:]
            if tag in " -":
                assert pos < len(src) and src[pos] == text, f"line {pos + 1} is {src[pos:pos + 1]!r}, diff says {text!r}"
                pos += 1
                if tag == " ":
                    out.append(text)
            else:
                assert tag == "+", f"bad diff line {lines[i]!r}"
                out.append(text)
            i += 1
    return "".join(out + src[pos:])


@pytest.mark.parametrize("kind", ["ddp", "fsdp", "trainer", "gpt", "prefetch", "torchtitan"])
def test_porting_guide_diff_applies_to_its_original(kind: str, tmp_path: Path) -> None:
    """The diff applies to the original printed beside it, the result compiles, and every line it adds
    is in the example that the kill tests above run (the guide shows what is tested)."""
    original, diff = _porting_block(kind, "original"), _porting_block(kind, "diff")
    ported = _apply_unified_diff(original, diff)
    compile(ported, f"{kind}_ported.py", "exec")
    example = {line.strip() for line in Path(EXAMPLE_OF[kind]).read_text().splitlines()}
    added = [line[1:].strip() for line in diff.splitlines()[2:] if line.startswith("+")]
    missing = [a for a in added if a and not a.startswith('"""') and a not in example]
    assert not missing, f"lines the {kind} diff adds but {EXAMPLE_OF[kind]} lacks: {missing}"
    assert "init_process_group" not in ported and "ckptless.init()" in ported


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_porting_guide_ported_script_runs(kind: str, tmp_path: Path) -> None:
    """The script the guide's diff produces trains to the end under ckptless-run (standalone, 2 workers)."""
    script = tmp_path / f"{kind}_ported.py"
    script.write_text(_apply_unified_diff(_porting_block(kind, "original"), _porting_block(kind, "diff")))
    log = tmp_path / "run.log"
    proc = subprocess.Popen(
        [PYTHON, "-m", "ckptless.launcher.main", "--standalone", "--nproc-per-node", "2", str(script),
         "--epochs", "1"],
        env=child_env(), stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True, start_new_session=True)
    code = wait_exit(proc, 240, f"the ported {kind} script")
    text = log.read_text(errors="replace")
    assert code == 0, text[-4000:]
    assert "epoch 0 loss" in text, text[-4000:]


# --- on a backend with NCCL's failure semantics (tests/harness/nccl_like.py) -------------------------


@pytest.mark.rotating(1)  # CI budget: tests/harness/rotation.py (the CI DDP kill runs daily on Gloo)
def test_ddp_on_nccl_semantics_kill_in_backward(module_etcd: EmbeddedEtcd, tmp_path: Path, ddp_baseline: dict) -> None:
    """The user's DDP groups on the NCCL-semantics backend: the survivors' all-reduce never fails by
    itself when rank 3 dies in backward; ckptless aborts the generation, nobody waits for the watchdog."""
    c = _kill_and_check(module_etcd, tmp_path / "ddp_nccl_r3_bwd", DDP_SCRIPT, (), 3, 5, "backward", ddp_baseline,
                        env=nccl_like.job_env())
    assert "[nccl_like] watchdog" not in c.log_text() and "[nccl_like] connected lazily" not in c.log_text()


@pytest.mark.rotating(2)  # CI budget: tests/harness/rotation.py (NCCL semantics: test_recovery_e2e daily)
def test_fsdp2_on_nccl_semantics_kill_rank0_in_backward(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                                         fsdp_baseline: dict) -> None:
    c = _kill_and_check(module_etcd, tmp_path / "fsdp_nccl_r0_bwd", FSDP_SCRIPT, (), 0, 5, "backward",
                        fsdp_baseline, env=nccl_like.job_env())
    assert "[nccl_like] watchdog" not in c.log_text() and "[nccl_like] connected lazily" not in c.log_text()


@pytest.mark.slow  # CI budget: the CI DDP kill above runs the same transfer code (a respawn instead of a spare)
def test_ddp_spare_takes_a_rank_and_gets_its_replicated_state_from_live_replicas(module_etcd: EmbeddedEtcd,
                                                                                 tmp_path: Path,
                                                                                 ddp_baseline: dict) -> None:
    """Issue 21 with a spare: rank 1 is killed at step 5; a spare on a third node (pre-built as rank 0,
    so it restarts warm as rank 1: DDP state is never adopted in place) receives the DDP parameters
    and AdamW state from the live replicas, the rest from rank 1's holder; bitwise, survivors kept."""
    out = tmp_path / "ddp_spare"
    c = _run(module_etcd, out, DDP_SCRIPT, (), EXAMPLE_PAUSE="1:5:start")
    try:
        c.start_agent()
        c.start_agent()
        doomed = c.paused_pid(1)
        before = c.worker_pids()  # before the spare's node exists: its standby process is no rank's yet
        c.start_agent("--spares", "1", nproc=0)
        with c.client() as cl:
            wait_until(lambda: bool(cl.get_prefix(Keyspace(c.job_id).spares_prefix)[0]), 120, "the spare")
        os.kill(doomed, signal.SIGKILL)
        c.wait()
    finally:
        c.kill_all()
    finals, pids = c.finals_with_pids()
    assert_bitwise_equal(finals, ddp_baseline)
    assert pids[1] != doomed
    for r in (0, 2, 3):
        assert pids[r] == before[r], f"survivor rank {r} was restarted"
    got = re.search(r"rank 1: resumed at step \d+ in generation 1 \(peers: (\d+) bytes from holders, "
                    r"(\d+) from live replicas\)", c.log_text())
    assert got is not None and int(got.group(2)) > int(got.group(1)), c.log_text()[-3000:]


@pytest.mark.slow  # CI budget: the second failure during a recovery runs in CI on the reference job
def test_ddp_second_failure_during_recovery_kills_a_replica_source(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                                                    ddp_baseline: dict) -> None:
    """Issue 21: rank a is killed at step 5; while that recovery is under way, rank b (one of the live
    replicas that serve a's parameters and AdamW state, and not a's holder nor held by it) dies too.
    The next plan rebuilds both, each one's replicated state from the replicas still alive, without
    the node-local tier; the run ends bitwise, the other two ranks in their first processes."""
    a, b = independent_pair()
    out = tmp_path / "ddp_second"
    c = _run(module_etcd, out, DDP_SCRIPT, (), EXAMPLE_PAUSE=f"{a}:5:start")
    try:
        c.start_agent("--no-shm-dir")
        c.start_agent("--no-shm-dir")
        doomed = c.paused_pid(a)
        before = c.worker_pids()
        os.kill(doomed, signal.SIGKILL)
        wait_membership(c, 1)  # the first recovery is under way ...
        os.kill(before[b], signal.SIGKILL)  # ... when a replica source dies
        c.wait()
    finally:
        c.kill_all()
    finals, pids = c.finals_with_pids()
    assert_bitwise_equal(finals, ddp_baseline)
    for r in set(range(WORLD)) - {a, b}:
        assert pids[r] == before[r], f"survivor rank {r} was restarted"
    assert pids[a] != doomed and pids[b] != before[b]
    m = c.membership()
    assert m is not None and m.generation >= 2
    text = c.log_text()
    for r in (a, b):
        assert re.search(rf"rank {r}: resumed at step \d+ in generation \d+ \(peers: \d+ bytes from holders, "
                         rf"\d+ from live replicas\)", text), text[-3000:]


# --- issue 21: replicas checked against each other (silent data corruption) --------------------------


def _flip_cluster(etcd: EmbeddedEtcd, out: Path, policy: str) -> ExampleCluster:
    """The DDP example with a chaos bit flip in rank 2's first parameter after its step 5 (before v5 is
    captured): v5 is where rank 2's replicated prefix first differs from ranks 1 and 3."""
    chaos = out / "chaos"
    chaos.mkdir(parents=True, exist_ok=True)
    c = _run(etcd, out, DDP_SCRIPT, (), CKPTLESS_CHAOS_DIR=str(chaos), CKPTLESS_CHAOS_POINTS="flip=flip:r2:5")
    c.start_agent("--on-replica-mismatch", policy)
    c.start_agent("--on-replica-mismatch", policy)
    return c


@pytest.mark.rotating(0)  # CI budget: tests/harness/rotation.py (its twin under "replace" runs on the other days)
def test_a_flipped_bit_in_one_replica_stops_the_job_naming_ranks_tensor_and_step(module_etcd: EmbeddedEtcd,
                                                                                  tmp_path: Path) -> None:
    """Policy ``stop`` (the default): found at the next round, never committed, one clear error naming
    rank 2 as the odd one, the parameter and the step; the agents end non-zero, nothing is respawned."""
    out = tmp_path / "sdc_stop"
    c = _flip_cluster(module_etcd, out, "stop")
    try:
        for a in c.agents:
            code = wait_exit(a, 180, "an agent of a job stopped by silent data corruption")
            assert code != 0, c.tail()
    finally:
        c.kill_all()
    flipped = json.loads((out / "chaos" / "flipped_flip.json").read_text())
    assert flipped["object"] == "model", flipped
    text = c.log_text()
    found = re.search(r"silent data corruption at step 5: rank 2 \(on [^)]*\) is the odd one: its replicated state "
                      r"differs from the copy that ranks 0, 1, 3 hold \(3 of 4, on several nodes\) in ([^;(\n]*)", text)
    assert found is not None, text[-4000:]
    assert found.group(1).strip() == "model.0.weight", found.group(0)  # that tensor, not every one of its chunk
    assert "SilentDataCorruption" in text
    assert not list(out.glob("final_rank*.pt")), "a rank finished the job after the corruption"


@pytest.mark.rotating(1)  # CI budget: tests/harness/rotation.py
def test_a_flipped_bit_in_one_replica_is_replaced_and_the_run_ends_bitwise(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                                                          ddp_baseline: dict) -> None:
    """Policy ``replace``: rank 2, whose prefix differs from both its neighbours while they agree, leaves
    as a failed device and is rebuilt from its replicas (their own images, checked against their own
    checksums, not against rank 2's corrupt manifest); the others keep their processes; the run ends
    bitwise equal to the fault-free one."""
    out = tmp_path / "sdc_replace"
    c = _flip_cluster(module_etcd, out, "replace")
    try:
        c.wait()
    finally:
        c.kill_all()
    finals, pids = c.finals_with_pids()
    assert_bitwise_equal(finals, ddp_baseline)
    flipped = json.loads((out / "chaos" / "flipped_flip.json").read_text())
    assert pids[2] != flipped["pid"], "rank 2 finished in the process whose parameter was corrupted"
    for r in (0, 1, 3):
        assert int(finals[r]["recoveries"]) == 1, f"rank {r}: {finals[r]['recoveries']} recoveries"  # type: ignore[call-overload]
    text = c.log_text()
    assert re.search(r"rank 2 \(on [^)]*\) is the odd one", text), text[-3000:]
    assert "this rank leaves to be rebuilt from its replicas" in text, text[-3000:]
    assert re.search(r"rank 2: resumed at step \d+ in generation 1", text), text[-3000:]


# --- issue 21: HSDP (FSDP2 on a replicate x shard mesh): shards recovered from their replica --------------

HSDP = ("--hsdp", "2")  # mesh [[0, 1], [2, 3]]: ranks 1 and 3 hold one shard, 0 and 2 the other


@pytest.fixture(scope="module")
def hsdp_baseline(module_etcd: EmbeddedEtcd, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, object]]:
    return _baseline(module_etcd, tmp_path_factory.mktemp("hsdp"), FSDP_SCRIPT, HSDP)


@pytest.mark.slow  # CI budget: the DDP kill runs the same replica transfers daily; HSDP differs in detection only
def test_hsdp_lost_rank_is_rebuilt_from_its_replica_peer(module_etcd: EmbeddedEtcd, tmp_path: Path,
                                                         hsdp_baseline: dict) -> None:
    """Rank 1 dies in step 5's backward; its parameter and optimizer shards come from rank 3 (the
    other replica of that shard, on the other node), only its private rest from its mirror holder.
    (This test found that a survivor whose shard group had finished a backward the replicate group
    never reduced kept those gradients on its unsharded parameters: state/fsdp.py clears them.)"""
    c = _kill_and_check(module_etcd, tmp_path / "hsdp_r1", FSDP_SCRIPT, HSDP, 1, 5, "backward", hsdp_baseline,
                        agent_args=("--no-shm-dir",), bitwise=False)
    got = re.search(r"rank 1: resumed at step \d+ in generation 1 \(peers: (\d+) bytes from holders, "
                    r"(\d+) from live replicas\)", c.log_text())
    assert got is not None, c.log_text()[-3000:]
    assert "silent data corruption" not in c.log_text()  # the replicas agreed at every round after it
    assert_bitwise_equal(c.finals_with_pids()[0], hsdp_baseline)


@pytest.mark.slow
def test_hsdp_both_replicas_of_a_shard_lost_at_once_are_rebuilt_from_mirrors(module_etcd: EmbeddedEtcd,
                                                                            tmp_path: Path,
                                                                            hsdp_baseline: dict) -> None:
    """Ranks 1 and 3, the two replicas of one shard, die in the same step: no live replica is left, so
    the job mirrors replicated state too (``--mirror-replicated``, K = 2 so that each keeps a holder
    that is not the other) and both are rebuilt from their holders, bitwise, the log saying so."""
    out = tmp_path / "hsdp_both"
    c = _run(module_etcd, out, FSDP_SCRIPT, HSDP, EXAMPLE_PAUSE="1:5:start,3:5:start")
    try:
        for _ in range(2):
            c.start_agent("--no-shm-dir", "--mirror-replicated", "--replicas", "2")
        doomed = [c.paused_pid(1), c.paused_pid(3)]
        for pid in doomed:
            os.kill(pid, signal.SIGKILL)
        c.wait()
    finally:
        c.kill_all()
    finals, pids = c.finals_with_pids()
    assert pids[1] not in doomed and pids[3] not in doomed
    text = c.log_text()
    for r in (1, 3):
        got = re.search(rf"rank {r}: resumed at step \d+ in generation 1 \((\w+)\)", text)
        assert got is not None and got.group(1) == "peers", text[-3000:]  # whole images from the holders
    assert_bitwise_equal(finals, hsdp_baseline)
