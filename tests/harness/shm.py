"""Peer-store images, holder files, child processes and tmpfs mounts for the ``--shm-dir`` tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from ckptless.mirror.store import PeerStore
from ckptless.state.checksum import chunk_checksums
from ckptless.state.manifest import Manifest

from .repo import REPO

CHUNK = 4096
JOB = "job/shm"


def make_image(owner: int, version: int, nbytes: int = 50_000, generation: int = 0, job: str = JOB,
               seed: int | None = None) -> tuple[Manifest, torch.Tensor]:
    """``owner``'s image of ``version`` (seeded by owner and version unless ``seed``) and its manifest."""
    g = torch.Generator().manual_seed(seed if seed is not None else owner * 1000 + version)
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return Manifest(job, owner, version, generation, nbytes, CHUNK, tuple(chunk_checksums(buf, CHUNK))), buf


def holder_files_of(shm_dir: str, job: str, node: str) -> None:
    """Holder 0 of ``job`` on ``node`` leaves one replica's files (a .bin and a .json) in ``shm_dir``."""
    s = PeerStore(job, shm_dir=shm_dir, holder=0, node=node)
    s.put(*make_image(1, 1, job=job))


def run_py(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``code`` (dedented) in a fresh Python that imports this checkout."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env)


@contextmanager
def mounted_tmpfs(d: Path, size: str) -> Iterator[None]:
    """A tmpfs of ``size`` mounted on the directory ``d`` (root only: the test is skipped where mount is
    not allowed), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(d)], capture_output=True)
