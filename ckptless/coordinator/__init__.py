"""ckptless.coordinator"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptless import lazy

__all__ = [
    "Compare", "Delete", "EtcdClient", "Get", "Put", "WatchEvent", "EtcdConfig", "Election", "EmbeddedEtcd", "Keyspace",
    "validate_job_id", "RelaySubscription", "RelayWriteTimeout", "RelayServer", "RelayClosed", "RelayWriter",
    "NodeInfo", "Rendezvous", "RendezvousResult", "RoundState", "config_disagreement", "Session",
]


# Imported on first use (ckptless/lazy.py): an importer of one module pays for no other.
if TYPE_CHECKING:
    from ckptless.coordinator.client import Compare, Delete, EtcdClient, Get, Put, WatchEvent
    from ckptless.coordinator.config import EtcdConfig
    from ckptless.coordinator.election import Election
    from ckptless.coordinator.embedded import EmbeddedEtcd
    from ckptless.coordinator.keyspace import Keyspace, validate_job_id
    from ckptless.coordinator.relay_client import RelaySubscription, RelayWriteTimeout
    from ckptless.coordinator.relay_server import RelayServer
    from ckptless.coordinator.relay_wire import RelayClosed
    from ckptless.coordinator.relay_writer import RelayWriter
    from ckptless.coordinator.rendezvous import NodeInfo, Rendezvous, RendezvousResult, RoundState, config_disagreement
    from ckptless.coordinator.session import Session

__getattr__ = lazy.exports(__name__, {
    "client": "Compare Delete EtcdClient Get Put WatchEvent",
    "config": "EtcdConfig",
    "election": "Election",
    "embedded": "EmbeddedEtcd",
    "keyspace": "Keyspace validate_job_id",
    "relay_client": "RelaySubscription RelayWriteTimeout",
    "relay_server": "RelayServer",
    "relay_wire": "RelayClosed",
    "relay_writer": "RelayWriter",
    "rendezvous": "NodeInfo Rendezvous RendezvousResult RoundState config_disagreement",
    "session": "Session",
})
