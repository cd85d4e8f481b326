"""Shared fixtures: a real etcd server (the bundled binary), never a mock."""

from __future__ import annotations

import os
import sys
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
