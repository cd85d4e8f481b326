"""The node machine's driver (launcher/node_driver.py) without processes or etcd: the slot table is read as
the event's facts and written under the driver's lock with the step that decided it, and each action
reaches its executor (a stand-in worker group records the signals)."""

from __future__ import annotations

import signal
from pathlib import Path

from ckptless.launcher.args import parse_args
from ckptless.launcher.node_driver import NodeDriver
from ckptless.launcher.node_machine import MembershipSeen, NodeConfig, Spawned, StopRequested, TeardownsStuck
from ckptless.launcher.node_state import NodeState
from ckptless.launcher.slots import Slot
from ckptless.recovery.decision import Assignment
from ckptless.recovery.wire import Membership


class _Group:
    def __init__(self) -> None:
        self.signals: list[tuple[int, int]] = []

    def send_signal(self, local_rank: int, sig: int) -> bool:
        self.signals.append((local_rank, sig))
        return True


def _driver(tmp_path: Path) -> tuple[NodeDriver, NodeState, _Group, list[float]]:
    cfg = parse_args(["--nproc-per-node", "2", "--no-shm-dir", "x.py"], {})
    st = NodeState(cfg, "n", str(tmp_path))
    for lr in range(2):
        st.slots.add(Slot(lr, f"n/w{lr}", lr, st.heartbeat_path(lr)))
    group = _Group()
    st.group = group  # type: ignore[assignment]
    clock = [100.0]
    driver = NodeDriver(st, NodeConfig("n", "h", 7), clock=lambda: clock[0])
    st.feed = driver.feed
    return driver, st, group, clock


def test_a_membership_dropping_a_worker_kills_it_and_unassigns_its_slot(tmp_path: Path) -> None:
    driver, st, group, _ = _driver(tmp_path)
    st.feed(Spawned())
    m = Membership(1, 2, "h", 7, (Assignment(0, "n/w0", "n", "survivor"), Assignment(1, "o/w1", "o", "respawn")))
    node = driver.feed(lambda slots: MembershipSeen(m, slots))
    assert node.membership == m and group.signals == [(1, signal.SIGKILL)]
    assert st.slots.get(1).rank is None and st.slots.get(1).last_rank == 1 and st.slots.get(0).rank == 0
    assert st.published_t.keys() == {1}


def test_a_stuck_teardown_is_noted_for_the_exit_recorder_before_the_kill(tmp_path: Path) -> None:
    driver, st, group, _ = _driver(tmp_path)
    driver.feed(TeardownsStuck(((0, 4242, 0, 40.0),)))
    driver.feed(TeardownsStuck(((0, 4242, 0, 41.0),)))
    assert st.killed_in_teardown == {4242} and group.signals == [(0, signal.SIGKILL)]


def test_a_tick_after_a_stop_signal_ends_with_128_plus_n(tmp_path: Path) -> None:
    driver, _, _, _ = _driver(tmp_path)
    driver.feed(StopRequested(15))
    assert driver.tick().exit_code == 143
