"""The node agent's decisions, through its machine (launcher/node_machine.py), with a fake clock.

What used to be ``follower.apply_membership`` (kills, adoptions, respawns, re-execs on the etcd watch
thread) and ``completion.done`` (the exit code, reading the clock and etcd) are transitions here: no
process, no etcd, no clock; the slot table and the job's exit records ride on the events.
"""

from __future__ import annotations

from dataclasses import replace

from ckptless.launcher.node_machine import (
    Heartbeat, HeartbeatsRead, TeardownsStuck, TouchHeartbeat, Assign, Exit, ExitRecorded, IncidentSeen, Kill, LeaseLost, LeaseRenewed, MembershipSeen, Node, NodeConfig,
    Log, NoteGeneration, NoteIncident, Reexec, ReexecAsked, RemoveDeadShm, Say, RefillWaitsForGpu, SendStatus, SpareDeferred, Spawned, StartRespawn,
    StartSpare, StatusSeen, StopRequested, Tick, step, wants_exits)
from ckptless.launcher.slots import Slot
from ckptless.recovery.decision import Assignment
from ckptless.recovery.view import ExitRecord, JobStatus
from ckptless.recovery.wire import Membership

CFG = NodeConfig("n", "h", 7, node_grace_s=10.0, lease_ttl_s=5.0)


def _slot(lr: int, rank: int | None, *, alive: bool = True, ok: bool = False, wid: str | None = None) -> Slot:
    return Slot(lr, wid or f"n/w{lr}", rank, f"hb{lr}", alive=alive, succeeded=ok, failed=not alive and not ok,
                spare=rank is None, ever_ranked=rank is not None)


def _m(gen: int, *ranks: tuple[int, str, str, str], host: str = "h", port: int = 7) -> Membership:
    return Membership(gen, len(ranks), host, port, tuple(Assignment(r, w, n, s) for r, w, n, s in ranks))


GEN0 = _m(0, (0, "n/w0", "n", "survivor"), (1, "n/w1", "n", "survivor"), (2, "o/w0", "o", "survivor"))


def _running(m: Membership = GEN0, cfg: NodeConfig = CFG) -> Node:
    return Node(cfg, membership=m, spawned=True)


def _exit(rank: int, wid: str, code: int | None = 0, sig: int | None = None) -> ExitRecord:
    return ExitRecord(rank=rank, worker_id=wid, node_id="n", pid=1, exitcode=code, signal=sig, time=0.0)


# --- following a membership (was follower.apply_membership) ------------------------------------------------
def test_a_membership_before_the_spawn_only_records_the_generation() -> None:
    node, acts = step(Node(CFG), MembershipSeen(GEN0, ()), 0.0)
    assert node.membership == GEN0 and acts == (NoteGeneration(0),)


def test_an_older_or_equal_generation_is_ignored() -> None:
    node = _running(_m(3, (0, "n/w0", "n", "survivor")))
    assert step(node, MembershipSeen(GEN0, (_slot(0, 0),)), 0.0) == (node, ())


def test_a_dropped_worker_is_killed_and_unassigned_a_spare_adopts_and_a_respawn_starts() -> None:
    slots = (_slot(0, 0), _slot(1, 1, alive=False), _slot(2, None, wid="n/spare0"))
    gen1 = _m(1, (0, "n/spare0", "n", "spare"), (1, "n/respawn-g1-r1", "n", "respawn"), (2, "o/w0", "o", "survivor"))
    node, acts = step(_running(), MembershipSeen(gen1, slots), 1.0)
    assert node.membership == gen1
    assert acts == (NoteGeneration(1), Kill(0, "worker n/w0 is not part of generation 1: killing it"),
                    Assign(0, None), Assign(1, None), Assign(2, 0),
                    StartRespawn(1, Assignment(1, "n/respawn-g1-r1", "n", "respawn"), 1))  # slot 1's worker is dead


def test_a_respawn_waits_for_the_worker_it_replaces_to_exit_with_a_deadline() -> None:
    gen1 = _m(1, (0, "n/r0", "n", "respawn"), (1, "n/w1", "n", "survivor"), (2, "o/w0", "o", "survivor"))
    r0 = Assignment(0, "n/r0", "n", "respawn")
    node, acts = step(_running(), MembershipSeen(gen1, (_slot(0, 0), _slot(1, 1))), 100.0)
    assert Kill(0, "worker n/w0 is not part of generation 1: killing it") in acts
    assert not any(isinstance(a, StartRespawn) for a in acts) and len(node.respawns) == 1
    rec = _exit(0, "n/w0", code=None, sig=9)
    started, acts = step(node, ExitRecorded(0, rec, True, False, False), 100.1)  # reaped: recorded first, then it starts
    assert acts == (StartRespawn(0, r0, 1),) and started.respawns == ()
    assert step(node, Tick((_slot(0, None), _slot(1, 1))), 109.9)[0].respawns == node.respawns
    late, acts = step(node, Tick((_slot(0, None), _slot(1, 1))), 110.0)
    assert late.respawns == () and acts == (Log("error", "rank 0: the worker it replaces (n/w0) did not exit; "
                                                         "not respawning"),)


def test_two_respawns_of_one_membership_take_two_slots() -> None:
    gen1 = _m(1, (0, "n/r0", "n", "respawn"), (1, "n/r1", "n", "respawn"), (2, "o/w0", "o", "survivor"))
    slots = (_slot(0, 0, alive=False), _slot(1, 1, alive=False))
    _, acts = step(_running(), MembershipSeen(gen1, slots), 0.0)
    assert [(a.local_rank, a.assignment.rank) for a in acts if isinstance(a, StartRespawn)] == [(0, 0), (1, 1)]


def test_a_hosted_rank_leaves_its_hosts_slot_alone_and_shm_is_cleared() -> None:
    gen1 = _m(1, (0, "n/w0", "n", "survivor"), (1, "n/w0", "n", "hosted"))
    node, acts = step(_running(cfg=replace(CFG, shm=True)), MembershipSeen(gen1, (_slot(0, 0),)), 0.0)
    assert acts == (NoteGeneration(1), Assign(0, 0), RemoveDeadShm())


def test_a_prebuilt_spare_restarts_as_its_rank_once_the_membership_assigning_it_arrives() -> None:
    spare = _slot(2, None, wid="n/spare0")
    node, acts = step(_running(), ReexecAsked(2, (spare,)), 0.0)
    assert acts == () and node.reexec_pending == {2}  # not assigned yet: it waits for the membership
    gen1 = _m(1, (0, "n/w0", "n", "survivor"), (1, "n/spare0", "n", "spare"), (2, "o/w0", "o", "survivor"))
    node, acts = step(node, MembershipSeen(gen1, (_slot(0, 0), _slot(1, 1, alive=False), spare)), 0.0)
    assert Reexec(2, "n/spare0", 1, 1) in acts and node.reexec_pending == frozenset()


def test_a_reexec_asked_after_its_membership_starts_at_once() -> None:
    node, acts = step(_running(), ReexecAsked(2, (_slot(2, 1, wid="n/spare0"),)), 0.0)
    assert acts == (Reexec(2, "n/spare0", 1, 0),) and not node.reexec_pending


def test_incidents_are_noted_once_and_waits_passed_on() -> None:
    node, acts = step(_running(), IncidentSeen(0, None), 0.0)
    assert acts == (NoteIncident(0, True, None),) and node.incidents == {0}
    node, acts = step(node, IncidentSeen(0, 12.5), 1.0)
    assert acts == (NoteIncident(0, False, 12.5),)


# --- exits -----------------------------------------------------------------------------------------------------
def test_without_recovery_the_first_failure_of_a_rank_ends_the_job() -> None:
    rec = _exit(1, "n/w1", code=1)
    node, acts = step(_running(cfg=replace(CFG, recovery=False)), ExitRecorded(1, rec, True, False, False), 0.0)
    assert node.local_failures == (rec,) and node.status is not None and node.status.state == "failed"
    assert acts == (SendStatus(JobStatus("failed", rec.describe(), rec)),)


def test_with_recovery_a_failure_is_only_kept_for_the_summary() -> None:
    rec = _exit(1, "n/w1", sig=9, code=None)
    node, acts = step(_running(), ExitRecorded(1, rec, True, False, False), 0.0)
    assert acts == () and node.local_failures == (rec,) and node.status is None
    assert step(node, ExitRecorded(1, rec, True, False, True), 0.0)[0] == node  # a requested stop: no failure


# --- when to leave (was completion.done) --------------------------------------------------------------------------
def test_a_stop_signal_leaves_with_128_plus_n_at_the_next_tick() -> None:
    node, _ = step(_running(), StopRequested(15), 0.0)
    node, acts = step(node, Tick((_slot(0, 0), _slot(1, 1))), 0.1)
    assert node.exit_code == 143 and acts == (Exit(143),)


def test_a_failed_job_leaves_with_1_and_a_left_node_ignores_everything_but_the_status() -> None:
    node, _ = step(_running(), StatusSeen(JobStatus("failed", "x")), 0.0)
    node, acts = step(node, Tick((_slot(0, 0),)), 0.0)
    assert acts == (Exit(1),)
    assert step(node, MembershipSeen(_m(5), ()), 0.0) == (node, ())
    assert step(node, StatusSeen(JobStatus("failed", "y")), 0.0)[0].status == JobStatus("failed", "y")


def test_a_node_whose_ranks_finished_leaves_with_0_unless_it_hosts_the_store() -> None:
    done = (_slot(0, 0, alive=False, ok=True), _slot(1, 1, alive=False, ok=True))
    elsewhere = _running(replace(GEN0, store_host="o"))
    assert not wants_exits(elsewhere, done)
    assert step(elsewhere, Tick(done), 0.0)[1] == (Exit(0),)
    host = _running()
    assert wants_exits(host, done)
    assert step(host, Tick(done, exits=None), 0.0) == (host, ())  # etcd did not answer: wait
    some = (_exit(0, "n/w0"), _exit(1, "n/w1"))
    assert step(host, Tick(done, some), 0.0) == (host, ())  # rank 2 (another node) still runs: the store stays
    node, acts = step(host, Tick(done, some + (_exit(2, "o/w0"),)), 0.0)
    assert acts == (SendStatus(JobStatus("succeeded", "all 3 ranks finished")), Exit(0))
    assert node.status == JobStatus("succeeded", "all 3 ranks finished")


def test_the_store_host_leaves_with_success_when_etcd_is_gone_past_the_grace() -> None:
    done = (_slot(0, 0, alive=False, ok=True), _slot(1, 1, alive=False, ok=True))
    node, _ = step(_running(), LeaseLost(), 100.0)
    assert step(node, Tick(done), 115.0) == (node, ())  # 15 s = grace + ttl: not past it yet
    node, acts = step(node, Tick(done), 115.5)
    assert node.exit_code == 0 and isinstance(acts[0], Say) and "unreachable for 16s" in acts[0].text


def test_a_lease_renewed_clears_the_outage_but_not_the_lapse() -> None:
    node, _ = step(_running(), LeaseLost(), 3.0)
    node2, _ = step(node, LeaseLost(), 9.0)
    assert node2.lost_since == 3.0  # the first loss counts
    node3, _ = step(node2, LeaseRenewed(), 10.0)
    assert node3.lost_since is None and node3.lease_lapsed_at == 3.0


def test_a_respawn_placed_here_but_not_started_yet_keeps_the_agent() -> None:
    """Issue 35 finding 8, through the machine: the membership moves both ranks to respawns on this node;
    between the unassignment and the respawns no slot holds a rank, and that is not "finished"."""
    gen1 = _m(1, (0, "n/r0", "n", "respawn"), (1, "n/r1", "n", "respawn"), (2, "o/w0", "o", "survivor"),
              host="o")
    slots = (_slot(0, 0, alive=False), _slot(1, 1, alive=False))
    node, acts = step(_running(), MembershipSeen(gen1, slots), 0.0)
    assert isinstance(acts[-1], StartRespawn)
    unassigned = tuple(replace(s, rank=None, last_rank=s.rank) for s in slots)
    assert step(node, Tick(unassigned), 1.0) == (node, ())


def test_ranks_moved_elsewhere_with_no_spare_left_leave_with_1_and_a_line() -> None:
    gen1 = _m(1, (0, "o/r0", "o", "respawn"), (1, "o/r1", "o", "respawn"), (2, "o/w0", "o", "survivor"),
              host="o", port=9)
    node, _ = step(_running(), LeaseLost(), 0.0)
    node, _ = step(node, LeaseRenewed(), 1.0)
    node, _ = step(node, MembershipSeen(gen1, (_slot(0, 0, alive=False), _slot(1, 1, alive=False))), 2.0)
    moved = (replace(_slot(0, None, alive=False), spare=False, ever_ranked=True, last_rank=0),
             replace(_slot(1, None, alive=False), spare=False, ever_ranked=True, last_rank=1))
    node, acts = step(node, Tick(moved), 3.0)
    assert node.exit_code == 1 and isinstance(acts[0], Say)
    assert "ranks [0, 1] run on other nodes since generation 1" in acts[0].text and "lost its lease" in acts[0].text


def test_a_node_cut_off_past_the_grace_with_its_workers_ended_leaves_with_1() -> None:
    dead = (_slot(0, 0, alive=False), _slot(1, 1, alive=False))
    node, _ = step(_running(replace(GEN0, store_host="o")), LeaseLost(), 0.0)
    assert step(node, Tick((_slot(0, 0), _slot(1, 1, alive=False))), 100.0)[0].exit_code is None  # a worker trains
    node, acts = step(node, Tick(dead), 100.0)
    assert node.exit_code == 1 and "cut off from etcd for 100s" in acts[0].text  # type: ignore[union-attr]


def test_a_spare_only_node_outlives_nobody() -> None:
    spares = (_slot(0, None, wid="n/spare0"),)
    node = _running()
    assert wants_exits(node, spares)
    assert step(node, Tick(spares, ()), 0.0) == (node, ())
    exits = (_exit(0, "n/w0"), _exit(1, "n/w1"), _exit(2, "o/w0"))
    assert step(node, Tick(spares, exits), 0.0)[1] == (Exit(0),)


def test_a_succeeded_status_ends_any_wait() -> None:
    node, _ = step(_running(), StatusSeen(JobStatus("succeeded", "done")), 0.0)
    assert step(node, Tick((_slot(0, 0, alive=False), _slot(1, 1))), 0.0)[1] == (Exit(0),)


# --- --spare-refill (was refill.maybe_refill and SparePool's counters) ------------------------------------------------
REFILL = replace(CFG, spares=1, spare_refill=True)
GEN1 = _m(1, (0, "n/w0", "n", "survivor"), (1, "n/spare0", "n", "spare"), (2, "o/w0", "o", "survivor"))
TRAINING = {"hb0": {"state": "training", "generation": 1}, "hb2": {"state": "training", "generation": 1}}


def _took(cfg: NodeConfig = REFILL) -> tuple[Node, tuple[Slot, ...]]:
    """Our spare (slot 2) took rank 1 in generation 1; slot 1's worker died."""
    before = (_slot(0, 0), _slot(1, 1, alive=False), _slot(2, None, wid="n/spare0"))
    node, _ = step(_running(cfg=cfg), MembershipSeen(GEN1, before), 0.0)
    after = (_slot(0, 0), replace(_slot(1, None, alive=False), spare=False, ever_ranked=True, last_rank=1),
             replace(_slot(2, 1, wid="n/spare0"), heartbeat_file="hb2"))
    return node, after


def test_a_spare_that_took_a_rank_is_owed_only_with_spare_refill() -> None:
    assert _took()[0].refills_owed == 1
    assert _took(replace(REFILL, spare_refill=False))[0].refills_owed == 0


def test_the_refill_starts_once_every_rank_here_trains_in_the_new_generation() -> None:
    node, slots = _took()
    assert step(node, Tick(slots, progress={"hb0": TRAINING["hb0"]}), 1.0) == (node, ())  # rank 1 still restores
    node2, acts = step(node, Tick(slots, progress=TRAINING), 1.0)
    assert acts == (StartSpare("n/spare1", 3, "h", 7),) and (node2.refills_owed, node2.refills_started) == (0, 1)
    deferred, _ = step(node2, SpareDeferred("n/spare1"), 1.5)  # etcd away: owed again, the same name next time
    assert step(deferred, Tick(slots, progress=TRAINING), 2.0)[1] == (StartSpare("n/spare1", 3, "h", 7),)


def test_a_refill_waits_for_another_incident_the_end_and_a_free_gpu() -> None:
    node, slots = _took()
    assert step(step(node, IncidentSeen(1, None), 1.0)[0], Tick(slots, progress=TRAINING), 1.0)[1] == ()
    assert step(replace(node, status=JobStatus("succeeded", "x")), Tick(slots, progress=TRAINING), 1.0)[1][-1] == Exit(0)
    waits, acts = step(node, Tick(slots, progress=TRAINING, gpu_free=False), 1.0)
    assert acts == (RefillWaitsForGpu(),) and waits.refills_owed == 1
    assert step(waits, Tick(slots, progress=TRAINING, gpu_free=False), 2.0)[1] == ()  # said once


def test_a_full_pool_settles_what_is_owed_without_starting_one() -> None:
    node, slots = _took()
    full = slots + (_slot(3, None, wid="n/spare9"),)
    node2, acts = step(node, Tick(full, progress=TRAINING), 1.0)
    assert acts == () and (node2.refills_owed, node2.refills_started) == (0, 1)


# --- the watchdog (was watchdog.watch_hangs and end_stuck_teardowns) -----------------------------------------------
def test_a_frozen_rank_is_killed_and_a_starting_one_gets_the_grace() -> None:
    node = _running(cfg=replace(CFG, hang_timeout_s=5.0))
    beats = (Heartbeat(0, 0, "n/w0", "hb0", 4.0), Heartbeat(1, 1, "n/w1", "hb1", 6.0, starting=False),
             Heartbeat(2, 2, "n/r2", "hb2", 59.0, starting=True), Heartbeat(3, 3, "n/r3", "hb3", 61.0, starting=True))
    _, acts = step(node, HeartbeatsRead(beats), 0.0)
    assert acts == (Kill(1, "rank 1 (n/w1) is frozen (no heartbeat for 6.0s): SIGKILL", "error"), TouchHeartbeat("hb1"),
                    Kill(3, "rank 3 (n/r3) is frozen (no heartbeat for 61.0s): SIGKILL", "error"), TouchHeartbeat("hb3"))
    assert step(_running(), HeartbeatsRead(beats), 0.0)[1] == ()  # no --hang-timeout: nothing is frozen


def test_a_worker_stuck_in_its_teardown_is_killed_once() -> None:
    node, acts = step(_running(), TeardownsStuck(((1, 41, 0, 31.0),)), 0.0)
    assert len(acts) == 1 and isinstance(acts[0], Kill) and acts[0].teardown_pid == 41 and acts[0].local_rank == 1
    assert "recorded as code 0" in acts[0].why and node.killed_in_teardown == {41}
    assert step(node, TeardownsStuck(((1, 41, 0, 32.0),)), 1.0) == (node, ())
