"""PeerStore: double buffering, ordering, rejection, memory reuse, /dev/shm re-attach."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from functools import partial

import pytest
import torch

from ckptless.errors import ConfigError, IntegrityError, StaleGeneration
from ckptless.mirror.config import MirrorConfig
from ckptless.mirror.reattach import attach
from ckptless.mirror.store import PeerStore, StaleVersion, file_prefix

from ..harness.shm import CHUNK
from ..harness.shm import make_image as shm_image

make_image = partial(shm_image, job="job")  # this file's images belong to job "job" unless told otherwise


def test_put_and_read_back_bitwise() -> None:
    s = PeerStore("job")
    m, buf = make_image(1, 1)
    s.put(m, buf)
    img = s.latest(1)
    assert img is not None and img.manifest == m and torch.equal(img.buffer, buf)
    assert s.get(1, 1) is not None and s.get(1, 2) is None
    assert s.owners() == [1] and s.versions(1) == [1]


def test_double_buffer_keeps_newest_complete_while_writing() -> None:
    s = PeerStore("job")
    for v in (1, 2):
        s.put(*make_image(0, v))
    assert s.versions(0) == [1, 2]
    m3, b3 = make_image(0, 3)
    view = s.begin(m3)  # overwrites the slot of v1, never v2
    assert s.versions(0) == [2]
    view.copy_(b3)
    s.complete(0)
    assert s.versions(0) == [2, 3]


def test_older_version_never_overwrites_newer() -> None:
    s = PeerStore("job")
    m5, b5 = make_image(0, 5)
    s.put(m5, b5)
    for v in (5, 4, 1):
        with pytest.raises(StaleVersion):
            s.put(*make_image(0, v))
    img = s.latest(0)
    assert img is not None and img.manifest.version == 5 and torch.equal(img.buffer, b5)
    # A newer generation orders after, even with a lower version (post-rollback).
    s.put(*make_image(0, 3, generation=1))
    assert s.latest(0).manifest.generation == 1  # type: ignore[union-attr]


def test_reject_other_job_and_older_generation() -> None:
    s = PeerStore("job", generation=2)
    with pytest.raises(StaleGeneration):
        s.put(*make_image(0, 1, generation=1))
    with pytest.raises(StaleGeneration):
        s.put(*make_image(0, 1, generation=2, job="other"))
    with pytest.raises(StaleGeneration):
        s.set_generation(1)
    assert s.owners() == []


def test_corrupt_transfer_caught_and_previous_kept() -> None:
    s = PeerStore("job")
    m1, b1 = make_image(0, 1)
    s.put(m1, b1)
    m2, b2 = make_image(0, 2)
    view = s.begin(m2)
    view.copy_(b2)
    view[12345] ^= 0xFF
    assert s.bad_chunks(0) == [12345 // CHUNK]
    with pytest.raises(IntegrityError):
        s.complete(0)
    assert s.versions(0) == [1] and torch.equal(s.latest(0).buffer, b1)  # type: ignore[union-attr]


def test_flipped_byte_at_rest_detected() -> None:
    s = PeerStore("job")
    m, b = make_image(2, 1)
    s.put(m, b)
    s.verify(2)
    s.latest(2).buffer[7] ^= 1  # type: ignore[union-attr]
    with pytest.raises(IntegrityError):
        s.verify(2)


def test_buffers_reused_and_memory_flat() -> None:
    s = PeerStore("job")
    for v in range(1, 4):
        s.put(*make_image(0, v))
    ptrs, held = s.slot_ptrs(), s.bytes_held
    for v in range(4, 60):
        s.put(*make_image(0, v, nbytes=50_000 - (v % 3)))  # smaller sizes fit in place
    assert s.slot_ptrs() == ptrs and s.bytes_held == held == 2 * 50_000


def test_discard_newer_after_rollback() -> None:
    s = PeerStore("job")
    for v in (1, 2):
        s.put(*make_image(0, v))
    s.discard_newer(1)
    assert s.versions(0) == [1]
    s.put(*make_image(0, 2, generation=1, seed=99))
    assert s.versions(0) == [1, 2]


def test_shm_backing_survives_and_reattaches(shm_dir: str) -> None:
    s = PeerStore("job/x", shm_dir=shm_dir, holder=1, node="n0")
    imgs = {}
    for owner in (0, 3):
        for v in (1, 2):
            m, b = make_image(owner, v, job="job/x")
            s.put(m, b)
            imgs[(owner, v)] = (m, b)
    m3, b3 = make_image(0, 3, job="job/x")
    s.begin(m3)[:100].copy_(b3[:100])  # crash mid-write: slot of v1 has no manifest any more
    names = os.listdir(shm_dir)
    assert all(n.startswith(file_prefix("job/x")) for n in names)
    t = attach(shm_dir, "job/x", holder=1, node="n0")
    assert t.versions(0) == [2] and t.versions(3) == [1, 2] and not t.rejected
    for owner, v in ((0, 2), (3, 1), (3, 2)):
        img = t.get(owner, v)
        m, b = imgs[(owner, v)]
        assert img is not None and img.manifest == m and torch.equal(img.buffer, b)
    # Another job sees nothing; corruption at rest is rejected on attach.
    assert attach(shm_dir, "other", holder=1, node="n0").owners() == []
    assert attach(shm_dir, "job/x", holder=2, node="n0").owners() == []
    t.get(3, 2).buffer[0] ^= 1  # type: ignore[union-attr]
    u = attach(shm_dir, "job/x", holder=1, node="n0")
    assert u.versions(3) == [1] and len(u.rejected) == 1


def test_shm_survives_sigkill_of_writer(shm_dir: str) -> None:
    code = textwrap.dedent(
        f"""
        import os, signal, torch
        from ckptless.mirror.store import PeerStore
        from ckptless.state.checksum import chunk_checksums
        from ckptless.state.manifest import Manifest
        buf = torch.arange(30000, dtype=torch.int64).to(torch.uint8)
        m = Manifest("job", 1, 7, 0, 30000, 4096, tuple(chunk_checksums(buf, 4096)))
        s = PeerStore("job", shm_dir={shm_dir!r}, holder=0)
        s.put(m, buf)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert proc.returncode == -9
    t = attach(shm_dir, "job", holder=0)
    img = t.latest(1)
    assert img is not None and img.manifest.version == 7
    assert torch.equal(img.buffer, torch.arange(30000, dtype=torch.int64).to(torch.uint8))


def test_config_validation() -> None:
    cfg = MirrorConfig.build(replicas=2, placement="group")
    assert cfg.validate_for_world(3) is cfg
    with pytest.raises(ConfigError) as ei:
        cfg.validate_for_world(2)
    assert ei.value.field == "replicas"
    for bad, field in (({"replicas": 0}, "replicas"), ({"mirror_every": 0}, "mirror_every"),
                       ({"timeout_s": -1}, "timeout_s"), ({"placement": "star"}, "placement"),
                       ({"chunk_bytes": 8192, "wire_bytes": 12288}, "wire_bytes"), ({"bogus": 1}, "bogus")):
        with pytest.raises(ConfigError) as ei:
            MirrorConfig.build(**bad)
        assert ei.value.field == field, (bad, ei.value)
