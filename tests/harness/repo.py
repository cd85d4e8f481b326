"""Where the repository is, and how a test starts a child Python that imports this checkout."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
HARNESS = Path(__file__).resolve().parent
SCRIPTS = HARNESS / "scripts"  # scripts the tests run as jobs or workers
ACTORS = HARNESS / "actors"  # processes the tests run against etcd


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    # The tests' jobs are CPU jobs, also on a GPU host: no GPU of the host is given out per spare, so a
    # test with more workers + spares than the host has GPUs is not refused (a test about GPUs sets it).
    env.setdefault("CKPTLESS_NODE_GPUS", "0")
    # ... and their workers make no CUDA communicator or context (a GPU test sets its backend).
    env.setdefault("CKPTLESS_CUDA_BACKEND", "none")
    return env
