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
    return env
