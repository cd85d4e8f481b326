"""Validated configuration of the last-resort disk snapshots.

Why validate up front (and touch the directory): a snapshot is only ever
needed after a disaster, which is the worst moment to learn that ``every``
was 0 or that the directory is read-only. Every problem is reported as a
:class:`ConfigError` naming the field and the value at construction time.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ckptless.coordinator import validate_job_id
from ckptless.errors import ConfigError

OnBusy = Literal["skip", "wait"]

def check_job_id(job_id: object) -> str:
    """``job_id`` becomes a directory name: the keyspace's rule already refuses anything that could escape it."""
    try:
        return validate_job_id(job_id)  # type: ignore[arg-type]  # validated inside
    except ConfigError as exc:
        raise ConfigError("job_id", job_id, exc.reason) from exc


@dataclass(frozen=True)
class SnapshotConfig:
    """Where, how often and how many snapshots to keep.

    ``every``: snapshot after every ``every``-th step (steps > 0).
    ``keep``: newest complete snapshots retained (>= 1; the newest complete
    one is never deleted).
    ``on_busy``: what :meth:`SnapshotWriter.maybe_snapshot` does when the
    previous snapshot is still being written: ``"skip"`` (default; never
    holds the training loop, logs a warning) or ``"wait"`` (blocks up to
    ``busy_wait_s``, then skips).
    ``completion_timeout_s``: how long rank 0 waits for all ranks' parts
    before giving the snapshot up (it then stays incomplete, never loaded).
    ``enabled=False`` turns the writer into a no-op and skips the
    directory checks.
    """

    directory: Path
    job_id: str
    every: int = 1000
    keep: int = 2
    enabled: bool = True
    on_busy: OnBusy = "skip"
    busy_wait_s: float = 60.0
    completion_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if not isinstance(self.directory, (str, Path)) or str(self.directory) == "":
            raise ConfigError("directory", self.directory, "must be a non-empty path")
        object.__setattr__(self, "directory", Path(self.directory))
        check_job_id(self.job_id)
        if type(self.enabled) is not bool:
            raise ConfigError("enabled", self.enabled, "must be a bool")
        if type(self.every) is not int or (self.enabled and self.every <= 0):
            raise ConfigError("every", self.every, "must be a positive int when snapshots are enabled")
        if type(self.keep) is not int or self.keep < 1:
            raise ConfigError("keep", self.keep, "must be an int >= 1")
        if self.on_busy not in ("skip", "wait"):
            raise ConfigError("on_busy", self.on_busy, "must be 'skip' or 'wait'")
        for name in ("busy_wait_s", "completion_timeout_s"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, (int, float)) or not math.isfinite(val) or val <= 0:
                raise ConfigError(name, val, "must be a finite number of seconds > 0")
        if self.enabled:
            _check_writable(self.directory)

    @property
    def job_dir(self) -> Path:
        return self.directory / self.job_id


def _check_writable(directory: Path) -> None:
    """Create the directory and prove a file can be written there."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".ckptless-probe-", dir=directory)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        raise ConfigError("directory", str(directory), f"is not a writable directory ({exc.strerror or exc})") from exc
