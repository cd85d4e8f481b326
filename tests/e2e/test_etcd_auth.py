"""etcd authentication against the real server (TLS needs certificates this repo does not generate)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ckptless.coordinator.client import EtcdClient
from ckptless.coordinator.config import EtcdConfig
from ckptless.coordinator.embedded import EmbeddedEtcd, etcd_binary
from ckptless.errors import CoordinatorAuthError, CoordinatorError


def _etcdctl(endpoint: str, *args: str) -> None:
    ctl = Path(etcd_binary()).with_name("etcdctl")
    subprocess.run([str(ctl), f"--endpoints={endpoint}", *args], check=True, capture_output=True, timeout=30)


def test_user_password_auth(etcd: EmbeddedEtcd) -> None:
    _etcdctl(etcd.endpoint, "user", "add", "root", "--new-user-password=s3cret")
    _etcdctl(etcd.endpoint, "role", "add", "root")
    _etcdctl(etcd.endpoint, "user", "grant-role", "root", "root")
    _etcdctl(etcd.endpoint, "auth", "enable")
    with EtcdClient(EtcdConfig((etcd.endpoint,), user="root", password="s3cret")) as c:
        c.put("/ckptless/auth/x", "1")
        kv = c.get("/ckptless/auth/x")
        assert kv is not None and kv.value == b"1"
    with pytest.raises(CoordinatorAuthError, match="root"):
        EtcdClient(EtcdConfig((etcd.endpoint,), user="root", password="wrong", connect_timeout_s=2))
    with pytest.raises(CoordinatorError):  # no credentials: every call is refused, clearly
        with EtcdClient(EtcdConfig((etcd.endpoint,), connect_timeout_s=2)) as anon:
            anon.put("/ckptless/auth/y", "1")
