"""Content checksums of snapshot files, and an in-process cache of verdicts.

Why per-file checksums: a size check cannot see a same-size bit flip, and the
manifest's CRC32C chunk checksums can only be checked after DCP has loaded
the tensors into memory - too late and too heavy for a planner (the
coordinator's leader) that must pick a snapshot *before* any rank loads one.
So every file a rank writes gets a CRC32C in its part record at save time
(the part record is covered by the marker's SHA-256, and the marker carries a
SHA-256 of itself), and a snapshot's content can be verified by streaming its
files once, in any process, without torch or a model.

Why CRC32C and not SHA-256 for data files: it runs at several GB/s with
SSE4.2 and releases the GIL on large buffers (the save path runs on a
background thread next to the training loop), and it detects every error
burst of up to 32 bits. It guards against corruption, not against an
attacker who can rewrite the part record *and* the marker; DCP's
``.metadata`` (a pickle) keeps its separate SHA-256 for that reason.

Why a cache, and its rule: choosing a snapshot reads every byte of it, and a
leader may choose several times during one job. A verdict (valid or the
reason it is not) is reused within one process only while every file of the
snapshot directory still has the same (inode, size, mtime_ns, ctime_ns). Any
write, rename, truncation or deletion changes that fingerprint and forces a
re-read; a verdict whose fingerprint changed *during* verification is not
stored. Corruption that changes no file metadata (bit rot under the file
system) is not seen by a cached verdict: :func:`load_snapshot` re-verifies
its own rank's files anyway and drops the cached verdict when they fail.
"""

from __future__ import annotations

import copy
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import crc32c

from ckptless.errors import IntegrityError, SnapshotError

READ_BLOCK = 8 << 20

T = TypeVar("T")


class SnapshotIntegrityError(SnapshotError, IntegrityError):
    """A snapshot file's content differs from the checksum recorded at save time.

    Both a :class:`SnapshotError` (the snapshot is unusable) and an
    :class:`IntegrityError` (bytes failed verification), so callers that
    catch either keep working. ``path`` is the corrupt file (or directory
    when the file is not known), ``step`` the snapshot's step.
    """

    def __init__(self, message: str, *, path: Path | None = None, step: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.step = step


@dataclass(frozen=True)
class FileSum:
    """Size and CRC32C of one file (``crc32c`` is None in format-1 records: size only)."""

    size: int
    crc32c: int | None = None

    def to_json(self) -> dict[str, int]:
        if self.crc32c is None:
            raise SnapshotError("format-2 part records need a crc32c for every file")
        return {"size": self.size, "crc32c": self.crc32c}


def file_sum(path: Path) -> FileSum:
    """Stream ``path`` once: its size and CRC32C.

    Reads into one reused buffer (no per-block allocation); crc32c releases
    the GIL for blocks >= 32 KiB, so a background caller barely slows the
    training thread.
    """
    buf = bytearray(READ_BLOCK)
    view = memoryview(buf)
    crc = 0
    size = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view)
            if not n:
                break
            crc = crc32c.crc32c(view[:n], crc)
            size += n
    return FileSum(size, int(crc))


def check_file(record: Path, step: int, path: Path, want: FileSum) -> None:
    """Raise naming ``path``, the record's field and the step when the file is missing or differs.

    A missing or resized file is a :class:`SnapshotError` (it may be an
    unfinished or tampered directory); same size but other bytes is a
    :class:`SnapshotIntegrityError`.
    """
    field = f"files.{path.name}"
    try:
        have = path.stat().st_size
    except OSError as exc:
        raise SnapshotError(f"{record}: field {field}.size={want.size}: {path} is missing (step {step})") from exc
    if have != want.size:
        raise SnapshotError(f"{record}: field {field}.size={want.size}: {path} has {have} bytes "
                            f"(truncated or replaced; step {step})")
    if want.crc32c is None:
        return
    try:
        got = file_sum(path)
    except OSError as exc:
        raise SnapshotError(f"{record}: field {field}: {path} unreadable ({exc}; step {step})") from exc
    if got.size != want.size or got.crc32c != want.crc32c:
        raise SnapshotIntegrityError(
            f"{record}: field {field}.crc32c={want.crc32c}: {path} has crc32c {got.crc32c} over {got.size} "
            f"bytes: content corrupt (step {step})", path=path, step=step)


Fingerprint = tuple[tuple[str, int, int, int, int] | tuple[str], ...]


def fingerprint(root: Path, names: Iterable[str], dirs: Iterable[str]) -> Fingerprint:
    """(name, inode, size, mtime_ns, ctime_ns) of ``names`` and of every entry in ``dirs``, under ``root``.

    Costs one ``stat`` per file and one listing per directory: no data is
    read. A missing name appears as ``(name,)``. ctime is included because
    restoring an mtime with ``utime`` still moves ctime.
    """
    out: list[tuple[str, int, int, int, int] | tuple[str]] = []

    def add(rel: str, p: Path) -> None:
        try:
            s = p.stat()
        except OSError:
            out.append((rel,))
            return
        out.append((rel, s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns))

    for name in names:
        add(name, root / name)
    for d in dirs:
        try:
            entries = sorted(os.listdir(root / d))
        except OSError:
            out.append((d + "/",))
            continue
        for e in entries:
            add(f"{d}/{e}", root / d / e)
    return tuple(out)


class VerdictCache(Generic[T]):
    """A bounded, thread-safe map key -> (fingerprint, verdict); see the module doc for the rule.

    A verdict is either a value or the :class:`SnapshotError` that explains
    why the snapshot is unusable; errors are re-raised as copies so that each
    raise gets a fresh traceback.
    """

    def __init__(self, max_entries: int = 64) -> None:
        self._max = max_entries
        self._lock = threading.Lock()
        self._items: OrderedDict[object, tuple[Fingerprint, T | SnapshotError]] = OrderedDict()

    def get(self, key: object, fp: Fingerprint) -> T | SnapshotError | None:
        with self._lock:
            hit = self._items.get(key)
            if hit is None or hit[0] != fp:
                return None
            self._items.move_to_end(key)
            verdict = hit[1]
        return copy.copy(verdict) if isinstance(verdict, SnapshotError) else verdict

    def put(self, key: object, fp: Fingerprint, verdict: T | SnapshotError) -> None:
        with self._lock:
            self._items[key] = (fp, verdict)
            self._items.move_to_end(key)
            while len(self._items) > self._max:
                self._items.popitem(last=False)

    def forget(self, match: object = None) -> None:
        """Drop every verdict (``match`` None) or those whose key's first element equals ``match``."""
        with self._lock:
            if match is None:
                self._items.clear()
                return
            for key in [k for k in self._items if isinstance(k, tuple) and k and k[0] == match]:
                del self._items[key]

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
