"""Periodic asynchronous disk snapshots (the last resort behind peer mirrors).

Why a CPU copy plus a background thread instead of ``dcp.async_save``: the
training loop pays only for one copy of its state into a *reused*, already
faulted-in CPU buffer (``Capturer.capture``: 3.5-4 GB/s plus CRC32C), while
``async_save`` blocked 0.2-0.4 s per call here and stages a fresh copy
(fresh pages fault in at ~1 GB/s on this class of machine). Everything after
the copy - the DCP write, the part record, the completion marker, retention -
runs on a background thread.

Why no collective: the writer thread must never issue collectives, since they
would interleave with the training loop's collectives and a rank that skips a
snapshot would hang the others. Completion is file based instead: each rank
renames its part record (``rank<r>.json``) into place after its DCP files
are on disk; rank 0 waits for all of them (deadline:
``completion_timeout_s``; a rank that fails writes ``rank<r>.failed`` so
rank 0 gives up at once), then renames the marker into place. The snapshot
directory must therefore be on a file system every rank sees. ``group`` is
accepted for API stability and not used.

At most one snapshot is in flight per writer. When the next one is due while
the previous is still writing, ``on_busy="skip"`` skips it (warning logged);
``"wait"`` blocks up to ``busy_wait_s`` first.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from ckptless.errors import CkptlessError, DiskFullError, SnapshotError
from ckptless.snapshot.config import SnapshotConfig
from ckptless.snapshot.integrity import file_sum
from ckptless.snapshot.reader import (
    MARKER, METADATA, PartRecord, SnapshotInfo, tensor_views, failed_name, marker_bytes, part_name, scan_steps,
    sha256_file, short_error, step_dir,
)
from ckptless.snapshot.restart import foreign_owner, marker_world
from ckptless.snapshot.retention import SnapshotEntry, plan_retention
from ckptless.state import Capturer, StateImage
from ckptless.state import StateRegistry
from ckptless.state import decode

log = logging.getLogger(__name__)


def _dcp_tree(node: Any) -> Any:
    """The manifest tree as DCP should see it: every tensor a plain CPU tensor leaf.

    DCP only treats values inside dicts and lists as separate entries; a
    tuple is one opaque (pickled) leaf. Tuples that hold tensors become lists,
    numpy arrays and device tensors become CPU tensors (views of the buffer).
    """
    if isinstance(node, list):
        return [_dcp_tree(v) for v in node]
    if not isinstance(node, dict) or len(node) != 1:
        return node
    ((tag, val),) = node.items()
    if tag == "Td":
        return {"T": val[0]}
    if tag == "N":
        return {"T": val}
    if tag == "t":
        items = [_dcp_tree(v) for v in val]
        return items if _has_tensor(items) else {"t": items}
    if tag == "d":
        return {"d": [[k, _dcp_tree(v)] for k, v in val]}
    if tag == "o":
        return {"o": [[[k, _dcp_tree(v)] for k, v in val[0]], val[1]]}
    return node


def _has_tensor(node: Any) -> bool:
    if isinstance(node, list):
        return any(_has_tensor(v) for v in node)
    if isinstance(node, dict) and len(node) == 1:
        ((tag, val),) = node.items()
        if tag == "T":
            return True
        if tag in ("d", "o"):
            pairs = val if tag == "d" else val[0]
            return any(_has_tensor(v) for _, v in pairs)
        return bool(tag == "t" and _has_tensor(val))
    return False


def _fqns(state: dict[str, Any], views: list[torch.Tensor]) -> list[str]:
    """DCP's fully qualified name of every tensor, by index (as DCP's save planner flattens)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict(state)
    where = {id(v): i for i, v in enumerate(views)}
    names: list[str | None] = [None] * len(views)
    for fqn, val in flat.items():
        i = where.get(id(val))
        if i is not None:
            names[i] = fqn
    missing = [i for i, n in enumerate(names) if n is None]
    if missing:
        raise SnapshotError(f"{len(missing)} tensor(s) are not separate DCP entries (first index {missing[0]})")
    return [n for n in names if n is not None]


def _disk_error(exc: BaseException, where: Path) -> CkptlessError:
    """Translate anything DCP or the OS raised; ENOSPC (possibly wrapped by DCP) becomes DiskFullError."""
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        e = stack.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            full = DiskFullError(f"{where}: no space left on device; older snapshots were kept")
            full.__cause__ = exc
            return full
        stack += [c for c in (e.__cause__, e.__context__) if c is not None]
        for fail in getattr(e, "failures", {}).values():  # DCP's CheckpointException
            stack += [x for x in (fail if isinstance(fail, tuple) else (fail,)) if isinstance(x, BaseException)]
    if isinstance(exc, CkptlessError):
        return exc
    err = SnapshotError(f"{where}: snapshot write failed: {short_error(exc)}")
    err.__cause__ = exc
    return err


def _atomic_write(path: Path, data: bytes) -> None:
    """Write, fsync, rename, fsync the directory: the file appears whole or not at all."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SnapshotWriter:
    """One rank's side of the periodic snapshots; see the module docstring.

    Not thread-safe: call it from the training loop's thread only.
    """

    def __init__(self, config: SnapshotConfig, registry: StateRegistry, rank: int, world_size: int,
                 group: Any = None) -> None:
        if type(world_size) is not int or world_size < 1:
            raise SnapshotError(f"invalid world_size={world_size!r}: must be an int >= 1")
        if type(rank) is not int or not 0 <= rank < world_size:
            raise SnapshotError(f"invalid rank={rank!r}: must be in [0, {world_size})")
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self._cap = Capturer(registry, config.job_id, rank)
        self._buf: torch.Tensor | None = None
        self._thread: threading.Thread | None = None
        self._prefault: threading.Thread | None = None
        self._error: BaseException | None = None
        self._closed = False
        self.last_complete: SnapshotInfo | None = None
        """Newest snapshot this writer completed (rank 0 only; others never see the marker)."""
        self.last_block_s = 0.0
        """Seconds the last started snapshot held the caller (state_dict + copy + checksums)."""
        self.last_write_s = 0.0
        """Seconds the last finished background write took (rank 0: including the wait for all ranks)."""
        self.last_checksum_s = 0.0
        """Seconds the last background write spent checksumming its files (part of ``last_write_s``)."""

    # --- training-loop side ---------------------------------------------------
    def due(self, step: int) -> bool:
        return self.config.enabled and step > 0 and step % self.config.every == 0

    def maybe_snapshot(self, step: int, generation: int = 0) -> bool:
        """Start a snapshot of the state after ``step`` if one is due; True if started.

        Returns after the state is copied; the write continues in the
        background. Errors of a *previous* background write are logged and
        kept for :meth:`wait`; they never stop training.
        """
        if not self.due(step):
            if self.config.enabled and step > 0 and self._buf is None and self._prefault is None and not self._closed:
                self._start_prefault()
            return False
        return self.snapshot(step, generation)

    def snapshot(self, step: int, generation: int = 0) -> bool:
        """Start a snapshot now, whatever ``every`` says (False if skipped: busy or disabled)."""
        if self._closed:
            raise SnapshotError("snapshot writer is closed")
        if not self.config.enabled:
            return False
        if self.busy:
            if self.config.on_busy == "wait":
                assert self._thread is not None
                self._thread.join(self.config.busy_wait_s)
            if self.busy:
                log.warning("rank %d: snapshot of step %d skipped: the previous one is still being written",
                            self.rank, step)
                # Say so where rank 0 looks: it then abandons this step at once instead of
                # waiting its whole completion timeout for a part that will never come.
                sdir = step_dir(self.config.directory, self.config.job_id, step)
                try:
                    sdir.mkdir(parents=True, exist_ok=True)
                except OSError:
                    pass
                self._mark_failed(sdir, SnapshotError("skipped: its previous snapshot was still being written"))
                return False
        if self._prefault is not None:  # the buffer is being faulted in: worth waiting for
            self._prefault.join(self.config.busy_wait_s)
            self._prefault = None
        t0 = time.perf_counter()
        need = self._cap.required_bytes()
        if self._buf is None or self._buf.numel() < need:
            self._buf = None  # free the old one first
            self._buf = self._cap.allocate(need)
        image = self._cap.capture(version=step, generation=generation, out=self._buf)
        self.last_block_s = time.perf_counter() - t0
        self._thread = threading.Thread(target=self._run, args=(image, step, generation),
                                        name=f"ckptless-snapshot-{step}", daemon=True)
        self._thread.start()
        return True

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _start_prefault(self) -> None:
        """Allocate and touch the copy buffer in the background, once.

        Why: fresh pages fault in at ~1 GB/s (2 s per 256 MiB on a loaded
        2-core machine), so without this the first snapshot would hold the
        training loop for the allocation rather than just the copy.
        """
        need = self._cap.required_bytes()

        def work() -> None:
            buf = self._cap.allocate(need)
            buf.zero_()
            self._buf = buf

        self._prefault = threading.Thread(target=work, name="ckptless-snapshot-prefault", daemon=True)
        self._prefault.start()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the in-flight write ends (default deadline: ``completion_timeout_s``).

        Raises the background write's error (:class:`DiskFullError`,
        :class:`SnapshotError`) once, or :class:`SnapshotError` at the deadline.
        """
        limit = self.config.completion_timeout_s if timeout is None else timeout
        if self._thread is not None:
            self._thread.join(limit)
            if self._thread.is_alive():
                raise SnapshotError(f"rank {self.rank}: snapshot still being written after {limit} s")
            self._thread = None
        err, self._error = self._error, None
        if err is not None:
            raise err

    def close(self, timeout: float | None = None) -> None:
        """Finish the in-flight write, then refuse new snapshots and free the buffer."""
        try:
            if self._prefault is not None:
                self._prefault.join(self.config.busy_wait_s)
            self.wait(timeout)
        finally:
            self._closed = True
            if not self.busy:
                self._buf = None

    # --- background side ------------------------------------------------------
    def _run(self, image: StateImage, step: int, generation: int) -> None:
        t0 = time.perf_counter()
        sdir = step_dir(self.config.directory, self.config.job_id, step)
        try:
            owner = foreign_owner(sdir, self.config.job_id, self.world_size)
            if owner is not None:  # another run's snapshot: writing here would destroy it (issue 17)
                raise SnapshotError(f"{sdir} holds {owner}, written by another run: left untouched, so the "
                                    f"snapshot of step {step} is skipped")
            self._write_part(image, sdir, step, generation)
            if self.rank == 0:
                self.last_complete = self._complete(sdir, step, generation)
                self._retain()
        except BaseException as exc:  # noqa: BLE001 - reported through wait()
            err = _disk_error(exc, sdir)
            self._error = err
            log.error("rank %d: snapshot of step %d failed: %s", self.rank, step, err)
            self._mark_failed(sdir, err)
        finally:
            self.last_write_s = time.perf_counter() - t0

    def _write_part(self, image: StateImage, sdir: Path, step: int, generation: int) -> None:
        rank_dir = sdir / f"rank{self.rank}"
        rank_dir.mkdir(parents=True, exist_ok=True)
        views = tensor_views(image.buffer, image.manifest)
        state = decode(_dcp_tree(image.manifest.tree), views)
        fqns = _fqns(state, views)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
                dcp.save(state, storage_writer=FileSystemWriter(str(rank_dir), sync_files=True), no_dist=True)
        except BaseException:
            shutil.rmtree(rank_dir, ignore_errors=True)  # give the space back; never touch older snapshots
            raise
        # Checksum what is on disk now (the pages are still cached, so this is
        # a memory-speed read): a later same-size flip in any file is then
        # caught before a planner chooses this snapshot (see integrity.py).
        t0 = time.perf_counter()
        files = {p.name: file_sum(p) for p in sorted(rank_dir.iterdir()) if p.is_file()}
        rec = PartRecord(self.config.job_id, step, generation, self.rank, self.world_size, files,
                         sha256_file(rank_dir / METADATA), tuple(fqns), image.manifest)
        self.last_checksum_s = time.perf_counter() - t0
        _atomic_write(sdir / part_name(self.rank), rec.to_bytes())

    def _complete(self, sdir: Path, step: int, generation: int) -> SnapshotInfo:
        """Rank 0: wait for every rank's part record, then write the marker last."""
        deadline = time.monotonic() + self.config.completion_timeout_s
        pause = 0.005
        pending = set(range(self.world_size))
        while True:
            for r in sorted(pending):
                if (sdir / failed_name(r)).exists():
                    reason = (sdir / failed_name(r)).read_text(errors="replace").strip()
                    raise SnapshotError(f"{sdir}: rank {r} failed to write its part: {reason}")
                if (sdir / part_name(r)).exists():
                    pending.discard(r)
            if not pending:
                break
            if time.monotonic() > deadline:
                raise SnapshotError(f"{sdir}: ranks {sorted(pending)} did not finish within "
                                    f"{self.config.completion_timeout_s} s; snapshot left incomplete")
            time.sleep(pause)  # a file-system poll: there is no collective to block on (see module doc)
            pause = min(pause * 2, 0.2)
        digests = []
        for r in range(self.world_size):
            part = sdir / part_name(r)
            rec = PartRecord.read(part, self.config.job_id, step, r, self.world_size)
            if rec.generation != generation:
                raise SnapshotError(f"{part}: field generation={rec.generation}: rank 0 wrote {generation}")
            digests.append(sha256_file(part))
        info = SnapshotInfo(sdir, self.config.job_id, step, self.world_size, generation, time.time(), tuple(digests))
        _atomic_write(sdir / MARKER, marker_bytes(info))
        log.info("snapshot of step %d complete at %s", step, sdir)
        return info

    def _retain(self) -> None:
        """Rank 0: apply the retention plan. A deleted snapshot loses its marker first.

        Each complete snapshot's marker is read for its world size (a small
        JSON file), so another world's snapshots are never deleted.
        """
        job = self.config.job_id
        found = scan_steps(self.config.directory, job)
        entries = []
        for s, p in found:
            done = (p / MARKER).exists()
            entries.append(SnapshotEntry(s, done, marker_world(p, job) if done else None))
        paths = dict(found)
        for s in plan_retention(entries, self.config.keep, self.world_size):
            p = paths[s]
            try:
                (p / MARKER).unlink(missing_ok=True)
            except OSError as exc:
                log.warning("retention: cannot remove %s: %s", p / MARKER, exc)
                continue
            shutil.rmtree(p, ignore_errors=True)
            log.info("retention: deleted %s", p)

    def _mark_failed(self, sdir: Path, err: BaseException) -> None:
        """Tell rank 0 this rank's part will not come (never inside another run's complete snapshot)."""
        try:
            if sdir.is_dir() and foreign_owner(sdir, self.config.job_id, self.world_size) is None:
                _atomic_write(sdir / failed_name(self.rank), str(err).encode("utf-8", "replace"))
        except OSError:
            pass  # the disk may be full: rank 0 then hits its deadline instead
