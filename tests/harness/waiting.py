"""Deadline-bounded waits on files and conditions (never bare sleeps)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.005) -> float:
    """Poll ``cond`` until true; return the time it took. Fails the test at the deadline."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)
    return time.monotonic() - start


def wait_json(path: Path, timeout_s: float) -> Any:
    wait_until(path.exists, timeout_s, f"file {path}")
    return json.loads(path.read_text())
