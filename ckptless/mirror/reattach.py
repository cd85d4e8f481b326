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
"""

from __future__ import annotations

import os

import torch

from ckptless.errors import IntegrityError, ManifestError
from ckptless.mirror.shm import os_error_text, reserve_mapping, stat_signature, unlink_quiet
from ckptless.mirror.slot_files import SlotFiles
from ckptless.mirror.store import PeerStore
from ckptless.state.replication import bad_held_chunks, held_bytes
from ckptless.state.manifest import Manifest


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
