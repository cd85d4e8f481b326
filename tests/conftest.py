"""Shared fixtures for ``tests/unit`` and ``tests/e2e``: a real etcd server (the bundled binary), never a mock.

Helpers that tests import (paths, child environments, clusters, waits) live in ``tests/harness``."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from ckptless.coordinator.client import EtcdClient
from ckptless.coordinator.config import EtcdConfig
from ckptless.coordinator.embedded import EmbeddedEtcd

from .harness.processes import Fifo
from .harness.rotation import rotate_items

if TYPE_CHECKING:
    from .harness.cluster import FaultFree


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """CI's time budget: the tests marked ``rotating`` take turns (tests/harness/rotation.py)."""
    rotate_items(items)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EmbeddedEtcd]:
    """A fresh etcd member on free ports with its own data dir."""
    server = EmbeddedEtcd(data_dir=tmp_path / "etcd", log_path=tmp_path / "etcd.log")
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def client(etcd: EmbeddedEtcd) -> Iterator[EtcdClient]:
    c = EtcdClient(EtcdConfig((etcd.endpoint,)))
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def job_id() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def module_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedEtcd]:
    """One real etcd for a module's multi-process e2e tests (each job uses its own key prefix)."""
    d = tmp_path_factory.mktemp("etcd")
    with EmbeddedEtcd(data_dir=d / "data", log_path=d / "etcd.log") as server:
        yield server


@pytest.fixture(scope="session")
def session_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedEtcd]:
    """A real etcd for what the whole session shares (the fault-free reference run)."""
    d = tmp_path_factory.mktemp("session-etcd")
    with EmbeddedEtcd(data_dir=d / "data", log_path=d / "etcd.log") as server:
        yield server


@pytest.fixture(scope="session")
def baseline(session_etcd: EmbeddedEtcd, tmp_path_factory: pytest.TempPathFactory) -> FaultFree:
    """The reference job without faults (tests/harness/scripts/train_ref.py: 2 agents x 2 workers, K = 1),
    once per session (six modules compare with it: it was run once per module, ~10 s each): its
    cluster (logs) and every rank's final state, which a recovered run must equal. Its final states
    depend on nothing but the script and its defaults, so which etcd it ran on does not matter."""
    from .harness.cluster import fault_free

    return fault_free(session_etcd.endpoint, tmp_path_factory.mktemp("base"))


@pytest.fixture
def dev_shm_dir() -> Iterator[Path]:
    """A fresh directory in /dev/shm (skipped where it is not writable), removed afterwards."""
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("/dev/shm is not writable here")
    d = Path(tempfile.mkdtemp(prefix="ckptless-test-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[str]:
    """A private directory standing in for /dev/shm (on tmpfs where /dev/shm is writable, else under
    ``tmp_path``), as a str; removed afterwards."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else str(tmp_path)
    d = os.path.join(base, f"ckptless-test-{os.getpid()}-{tmp_path.name}")
    os.makedirs(d, exist_ok=True)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[Fifo]:
    """A named pipe the test reads lines from (workers open it by path and write)."""
    f = Fifo(tmp_path / "sync")
    yield f
    f.close()
