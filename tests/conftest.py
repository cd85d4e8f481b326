"""Shared fixtures: a real etcd server (the bundled binary), never a mock."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ckptless.coordinator.client import EtcdClient
from ckptless.coordinator.config import EtcdConfig
from ckptless.coordinator.embedded import EmbeddedEtcd

REPO = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


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


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.fixture(scope="module")
def module_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedEtcd]:
    """One real etcd for a module's multi-process e2e tests (each job uses its own key prefix)."""
    d = tmp_path_factory.mktemp("etcd")
    with EmbeddedEtcd(data_dir=d / "data", log_path=d / "etcd.log") as server:
        yield server


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A fresh directory in /dev/shm (skipped where it is not writable), removed afterwards."""
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("/dev/shm is not writable here")
    d = Path(tempfile.mkdtemp(prefix="ckptless-test-", dir="/dev/shm"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)
