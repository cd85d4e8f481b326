"""The GPU tests (``make test-gpu``): skipped as a whole where CUDA is not available.

Each test runs its case in a fresh process (``run_script``): NCCL and CUDA state
must not leak from one case into the next, and a case that hangs a thread in
NCCL must not hang the test run. Results (JSON) go to ``$CKPTLESS_GPU_OUT``
(the folder ``make test-gpu GPU_OUT=...`` is given; a temporary one otherwise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (make test-gpu on a GPU machine)")
    emulated = {"/test_multi_gpu.py": bool(os.environ.get("TEST_MULTI_GPU_ON_CPU")),  # their own checks on CPU
                "/test_shared_gpu.py": bool(os.environ.get("TEST_SHARED_GPU_ON_CPU"))}
    for item in items:
        path = str(item.fspath).replace(os.sep, "/")
        if "tests/gpu/" in path and not any(on and path.endswith(name) for name, on in emulated.items()):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu_out() -> Path:
    d = Path(os.environ.get("CKPTLESS_GPU_OUT") or tempfile.mkdtemp(prefix="ckptless-gpu-"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def run_script(out: Path, name: str, *args: str, timeout: float = 150, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``scripts/<name>.py *args OUT_JSON`` in a fresh interpreter; returns what it wrote."""
    case = "-".join(Path(a).name for a in args) or "run"  # an argument may be a path: name the files by its last part
    result = out / f"{name}-{case}.json"
    # TORCH_NCCL_NONBLOCKING_TIMEOUT: how long torch waits for a non-blocking NCCL init, and so how long
    # an abort of one can block (see ckptless/worker/nccl.py); ckptless sets it in init(), these scripts here.
    full = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
                CUBLAS_WORKSPACE_CONFIG=":4096:8", TORCH_NCCL_NONBLOCKING_TIMEOUT="20")
    full.update(env or {})
    proc = subprocess.run([sys.executable, str(SCRIPTS / f"{name}.py"), *args, str(result)], env=full,
                          capture_output=True, text=True, timeout=timeout)
    (out / f"{name}-{case}.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, f"{name} {args} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}"
    return json.loads(result.read_text()) if result.exists() else {}
