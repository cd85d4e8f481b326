"""Re-attaching a holder's ``/dev/shm`` replicas after its process died (the restart path of the peer store).

Why a module of its own: it runs once per process start, reads files a dead
predecessor may have left half-written, and must trust none of them; the
store's hot path (a mirror round) never needs it. It builds on the store
(:func:`attach` returns a :class:`~ckptless.mirror.store.PeerStore`); the
store never imports it.

What is kept: a slot whose manifest exists (written only after its payload
verified), names this job and owner, fits the payload file, and whose every
chunk checksum matches now. Anything else is listed in ``store.rejected``; its
payload file stays as a reusable slot when its pages can be reserved, and is
removed when they cannot (a sparse file on a full tmpfs would SIGBUS the next
write, issue 17). Temp files of a crashed write are removed.

Read-only readers (issue 35, the planner's R11): the node agent, when it
reaps a worker, lists the replicas that worker's files hold and checks every
chunk (:func:`verified_copies`, for the exit record), and another live worker
on the node that the plan has adopt one maps it privately and checks it again
(:func:`open_copy`). Neither removes or rewrites anything: the files stay the
dead holder's until a respawn of its rank re-attaches them.
"""

from __future__ import annotations

import logging
import os

import torch

from ckptless.errors import IntegrityError, ManifestError
from ckptless.mirror.shm import holder_files, os_error_text, reserve_mapping, slot_path, stat_signature, unlink_quiet
from ckptless.mirror.slot_files import SlotFiles
from ckptless.mirror.store import PeerStore
from ckptless.state import bad_held_chunks, held_bytes
from ckptless.state import Manifest

log = logging.getLogger(__name__)


def attach(shm_dir: str, job_id: str, *, holder: int, node: str | None = None) -> PeerStore:
    """Re-open the replicas a previous incarnation of this holder left in ``shm_dir``.

    Only this (job, node, holder)'s files are considered; see :func:`reattach`
    for which slots are kept.
    """
    return reattach(PeerStore(job_id, 0, shm_dir, holder=holder, node=node, keep_files=True))


def reattach(store: PeerStore) -> PeerStore:
    """Fill a fresh file-backed ``store`` (built with ``keep_files=True``) from its identity's files."""
    files = store.files
    assert files is not None
    for f in files.existing():
        path = os.path.join(files.shm_dir, f.name)
        if f.tmp:
            unlink_quiet(path)
            continue
        if f.kind != "bin":
            continue
        assert f.owner is not None and f.slot is not None
        owner, idx = f.owner, f.slot
        size = os.path.getsize(path)
        buf: torch.Tensor | None = None
        if size > 0:
            try:
                buf = reserve_mapping(path, size)  # a no-op for pages already written
            except (OSError, RuntimeError) as exc:
                files.forget(owner, idx)
                unlink_quiet(path)
                store.rejected.append((path, f"cannot reserve its pages: {os_error_text(exc)}"))
                continue
        stat = stat_signature(path)  # after the reservation, before the checksums: what the verdict is about
        manifest = None
        try:
            manifest = _verified_manifest(files, owner, idx, buf, size)
        except (ManifestError, IntegrityError, OSError) as exc:
            store.rejected.append((path, str(exc)))
        store.adopt(owner, idx, buf, manifest, stat)
    return store


def _verified_manifest(files: SlotFiles, owner: int, idx: int, buf: torch.Tensor | None,
                       size: int) -> Manifest | None:
    """The slot's manifest if it tells the truth about ``buf``; None if there is none (never completed)."""
    mpath = files.path(owner, idx, "json")
    if not os.path.exists(mpath):
        return None  # payload never completed: an empty, reusable slot
    with open(mpath, "rb") as fh:
        m = Manifest.from_bytes(fh.read())
    if m.job_id != files.job_id or m.owner != owner:
        raise ManifestError(f"manifest names job {m.job_id!r} owner {m.owner}")
    if held_bytes(m) > size or buf is None and held_bytes(m):
        raise ManifestError(f"payload file holds {size} bytes, manifest wants {held_bytes(m)}")
    if held_bytes(m) and bad_held_chunks(buf, m):  # type: ignore[arg-type]
        raise IntegrityError("checksum mismatch")
    return m


# --- read-only: another process looks at a dead holder's slots (the node-local tier, R11) -----------
def _read_slot(shm_dir: str, job_id: str, node: str | None, holder: int, owner: int, slot: int
               ) -> tuple[Manifest, torch.Tensor] | None:
    """Slot ``slot`` of ``owner`` in ``holder``'s files: its manifest and a private (copy-on-write, never
    written back) mapping of its held bytes, checksummed; None when it has no manifest. Raises
    ``ManifestError``/``IntegrityError``/``OSError`` when it does not tell the truth."""
    mpath = slot_path(shm_dir, job_id, node, owner, holder, slot, "json")
    if not os.path.exists(mpath):
        return None
    with open(mpath, "rb") as fh:
        m = Manifest.from_bytes(fh.read())
    if m.job_id != job_id or m.owner != owner:
        raise ManifestError(f"{mpath} names job {m.job_id!r} owner {m.owner}")
    path = slot_path(shm_dir, job_id, node, owner, holder, slot, "bin")
    n = held_bytes(m)
    if os.path.getsize(path) < n:
        raise ManifestError(f"{path} holds {os.path.getsize(path)} bytes, its manifest wants {n}")
    buf = torch.from_file(path, shared=False, size=n, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    bad = bad_held_chunks(buf, m) if n else []
    if bad:
        raise IntegrityError(f"replica of owner {owner} v{m.version} in {path}: corrupt chunks {bad[:8]}")
    return m, buf


def verified_copies(shm_dir: str, job_id: str, node: str | None, holder: int) -> list[Manifest]:
    """The complete replicas a dead holder left on this node whose every chunk checks now (what its agent
    reports in the exit record). Reads only: nothing is removed or rewritten (a respawn's :func:`attach`
    does that). A slot that does not check is logged and skipped."""
    out = []
    for f in holder_files(shm_dir, job_id, node, holder):
        if f.kind != "bin" or f.tmp or f.owner is None or f.slot is None:
            continue
        try:
            found = _read_slot(shm_dir, job_id, node, holder, f.owner, f.slot)
        except (ManifestError, IntegrityError, OSError, RuntimeError) as exc:
            log.warning("holder %d's replica in %s is not offered: %s", holder, f.name, exc)
            continue
        if found is not None:
            out.append(found[0])
    return sorted(out, key=lambda m: (m.owner, m.version))


def open_copy(shm_dir: str, job_id: str, node: str | None, holder: int, owner: int, version: int,
              generation: int, n_chunks: int) -> tuple[Manifest, torch.Tensor]:
    """The replica of ``owner`` the plan named (version, generation, chunk count) in ``holder``'s files on this
    node, re-verified: its manifest and held bytes. Raises :class:`IntegrityError` when it is gone or differs."""
    for slot in (0, 1):
        try:
            found = _read_slot(shm_dir, job_id, node, holder, owner, slot)
        except (ManifestError, OSError, RuntimeError) as exc:
            raise IntegrityError(f"holder {holder}'s replica of rank {owner}: {exc}") from exc
        if found is not None and (found[0].version, found[0].generation,
                                  len(found[0].chunk_checksums)) == (version, generation, n_chunks):
            return found
    raise IntegrityError(f"no replica of rank {owner} v{version} (generation {generation}, {n_chunks} chunks) "
                         f"in holder {holder}'s files in {shm_dir}")
