"""What a node agent's threads share: its handles (etcd, lease, workers, slot table, outbox) and the machine's feed.

Why one object of its own: the agent's work runs on several threads. The
reaper records exits (launcher/exit_records.py), the etcd watch follows
memberships (launcher/follower.py), a respawn thread starts replacements
(launcher/respawn.py), and the main loop refills spares (launcher/refill.py).
What the agent *decides* (kills, respawns, re-execs, its exit code) is not
here: it is the node machine's state (launcher/node_machine.py), which each
thread reaches only through ``feed`` (launcher/node_driver.py). Each of those
takes this state explicitly instead of reaching into the agent; the agent
(launcher/agent.py) creates it, fills in the handles as it connects, and
wires the others together.

Locking: the slot table has its own lock (and the driver's lock around a
step and the slot writes it asks for); every other field is written by one
thread and read by others as a whole (a reference swap).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping

from ckptless import environment
from ckptless.coordinator import EtcdClient
from ckptless.coordinator import Keyspace
from ckptless.coordinator import RelayServer
from ckptless.coordinator import Session
from ckptless.launcher.args import LaunchConfig
from ckptless.launcher.devices import device_env, spare_device_env
from ckptless.launcher.node_machine import Event
from ckptless.launcher.outbox import Outbox
from ckptless.launcher.slots import Slot, SlotTable
from ckptless.launcher.spares import SparePool
from ckptless.launcher.workers import WorkerGroup
from ckptless.metrics import MetricsExporter


class NodeState:
    def __init__(self, cfg: LaunchConfig, node_id: str, hb_dir: str, gpus: int = 0) -> None:
        self.cfg = cfg
        self.node_id = node_id
        self.keyspace = Keyspace(cfg.run_id)
        self.hb_dir = hb_dir  # this node's heartbeat and exit files (removed with the agent)
        self.recovery = cfg.replicas > 0  # turned off when the world is too small to mirror
        self.wake = threading.Event()  # the main loop looks again now
        self.stopping = threading.Event()  # a signal asked us to stop: every wait obeys it
        self.stop_signal: int | None = None  # the signal handler's note; the main loop feeds it to the machine
        # The node machine's input (launcher/node_driver.py's feed, set once the job formed; until then nothing
        # runs that could feed it, and a test without a machine drops what it would be told).
        self.feed: Callable[[Event | Callable[[tuple[Slot, ...]], Event]], object] = lambda event: None
        self.client: EtcdClient | None = None
        self.session: Session | None = None
        self.group: WorkerGroup | None = None
        self.host = ""  # this node's address: its TCPStore's host
        self.store_port = 0
        self.slots = SlotTable(gpus)  # also which GPU each slot uses (launcher/devices.py)
        self.killed_in_teardown: set[int] = set()  # pids the driver killed after their program ended (exit_records reads)
        self.incident_t: dict[int, float] = {}  # generation -> when its incident opened (for metrics)
        self.published_t: dict[int, float] = {}
        self.metrics: MetricsExporter | None = None
        self.outbox = Outbox(lambda: self.client, self.stopping)
        self.relay: RelayServer | None = None  # the node's control relay to its workers (set once the job formed)
        self.spares = SparePool(self.keyspace, node_id, lambda: self.client, any_rank=cfg.spare_any_rank)

    def spare_device_env(self, local_rank: int, gpu: int | None) -> Mapping[str, str]:
        """LOCAL_RANK / CUDA_VISIBLE_DEVICES of a spare in ``local_rank`` on ``gpu`` (launcher/devices.py)."""
        return spare_device_env(local_rank, gpu, self.cfg.virtual_local_rank, environment.environ())

    def respawn_device_env(self, gpu: int | None) -> Mapping[str, str]:
        """What a respawn's environment changes for its GPU: nothing without one (a CPU job keeps its
        LOCAL_RANK), else the variables that put it on ``gpu`` (kept, or another after a GPU failure)."""
        return {} if gpu is None else device_env(gpu, self.cfg.virtual_local_rank, environment.environ())

    def exit_path(self, local_rank: int) -> str:
        return os.path.join(self.hb_dir, f"exit{local_rank}.json")

    def heartbeat_path(self, local_rank: int) -> str:
        return os.path.join(self.hb_dir, f"hb{local_rank}")
