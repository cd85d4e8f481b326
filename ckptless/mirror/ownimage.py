"""The node-local tier: a rank's own committed image kept in node-local shared memory.

Why: the owner's committed image lives in its mirror engine's capture pool,
i.e. in the process, and dies with it. A worker respawned on the same node
would then pull its whole image (S bytes) from its holders over the network.
With ``shm_dir`` set, the capture pool itself is made of files in that
directory (``/dev/shm``: RAM, survives the process), so the committed image
outlives a SIGKILL at no extra copy and no extra memory: the capture writes
straight into the file's pages, exactly as it wrote into anonymous memory.

Which buffer holds the committed image is said by a manifest file beside it
(``<buffer>.json``: :meth:`Manifest.to_bytes`, strict JSON, never pickle),
written only when that version commits, through a temp name and
``os.replace``. The invariant, kept by :class:`OwnImageFiles` together with
the engine's buffer states:

    a ``.json`` file exists only beside a buffer that holds, unmodified, the
    committed image it describes.

So the manifest of the newer commit is written *before* the older one is
removed, and a buffer's manifest is removed *before* the buffer is handed out
for another capture (``pool_buffers=1``) or regrown. A crash at any point
leaves only manifests that tell the truth; the chunk checksums in them catch
anything else (a bit flip at rest, a stray writer).

Readers: the node agent, when it reaps a dead worker, calls
:func:`newest_verified` (every chunk checksummed) and reports the version in
the exit record; the planner lets a respawn *on this node* restore from it;
the respawned worker maps it with :func:`open_verified`, which checks the
checksums again before anything is restored.

Lifetime: the files belong to the node's owner record like every other
ckptless file in ``shm_dir`` (:mod:`ckptless.mirror.shm`): the agent removes
them when the job ends, a start-up cleanup removes a dead agent's, and so do
the surviving agents of the job when a lost node shared their directory.
A buffer the directory cannot take (ENOSPC) is plain memory instead, said
once per rank: the image is then not offered to a respawn. An engine
removes its own files on :meth:`OwnImageFiles.close`, and at its first commit
the files older engines of the rank left (a predecessor process, an earlier
generation of this one), which nothing reads once a newer image committed.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
from dataclasses import dataclass

import torch

from ckptless.errors import IntegrityError, ManifestError
from ckptless.mirror.shm import FallbackNotice, own_files, own_path, reserve_mapping, unlink_quiet
from ckptless.state import host_memory
from ckptless.state import bad_chunks
from ckptless.state import Manifest

log = logging.getLogger(__name__)


class NodeLocalImageError(IntegrityError):
    """The node-local own image the plan named is missing, different or corrupt (restore from peers)."""


# --- writer (the owner's mirror engine) -----------------------------------------------------------
class OwnImageFiles:
    """File-backed capture buffers of one rank and the manifest of the committed one.

    Not thread-safe by itself: the engine calls it under its own lock, except
    :meth:`publish`, which writes only a manifest file of a buffer no one else
    writes (an in-flight round's).
    """

    def __init__(self, shm_dir: str, job_id: str, node: str | None, rank: int) -> None:
        self.shm_dir, self.job_id, self.node, self.rank = shm_dir, job_id, node, rank
        self.token = secrets.token_hex(4)
        self._seq = itertools.count()
        self._swept = False
        self.notice = FallbackNotice(shm_dir, f"rank {rank}", "a respawn on this node will pull it from peers")
        os.makedirs(shm_dir, exist_ok=True)

    @property
    def disabled_reason(self) -> str:
        """Why a buffer could not be placed in ``shm_dir`` (then: memory); "" while every one was."""
        return self.notice.reason

    def _path(self, index: int, ext: str) -> str:
        return own_path(self.shm_dir, self.job_id, self.node, self.rank, self.token, index, ext)

    def allocate(self, nbytes: int) -> tuple[torch.Tensor, str | None]:
        """A buffer of ``nbytes`` backed by a fresh file, or (anonymous memory, None) if shm is full.

        The file's pages are reserved up front (:func:`reserve_mapping`): a
        full tmpfs then fails here with ENOSPC instead of killing the training
        process with SIGBUS on its first write into the mapping. The first
        fallback is a warning naming the directory, the errno and the size.
        """
        nbytes = max(nbytes, 1)
        path = self._path(next(self._seq), "bin")
        try:
            return reserve_mapping(path, nbytes, create_new=True), path
        except (OSError, RuntimeError) as exc:
            unlink_quiet(path)
            self.notice.report("own image buffer", nbytes, exc)
            return host_memory.empty(nbytes), None

    def publish(self, path: str | None, manifest: Manifest) -> None:
        """``manifest`` committed in the buffer at ``path``: say so (atomically), before older ones go."""
        if path is None:
            return
        target = path[: -len(".bin")] + ".json"
        tmp = target + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(manifest.to_bytes())
            os.replace(tmp, target)
        except OSError as exc:  # full: the image stays usable here, only a respawn cannot find it
            unlink_quiet(tmp)
            self.notice.report(f"manifest of own image v{manifest.version}", len(manifest.to_bytes()), exc)

    def retract(self, path: str | None) -> None:
        """The buffer at ``path`` no longer holds the committed image (or is about to be rewritten)."""
        if path is not None:
            unlink_quiet(path[: -len(".bin")] + ".json")

    def release(self, path: str | None) -> None:
        """The buffer at ``path`` is dropped (regrown): its manifest first, then its file."""
        if path is not None:
            self.retract(path)
            unlink_quiet(path)

    def sweep_others(self) -> list[str]:
        """Once, after this engine's first commit: remove what older engines of this rank left here.

        Nothing reads them any more: a recovery restores before the new engine
        commits, and a later respawn must use the newer image.
        """
        if self._swept:
            return []
        self._swept = True
        old = [f for f in own_files(self.shm_dir, self.job_id, self.node, self.rank) if f.token != self.token]
        removed = []
        for f in sorted(old, key=lambda f: f.kind != "own_json"):  # manifests first
            path = os.path.join(self.shm_dir, f.name)
            if unlink_quiet(path):
                removed.append(path)
        return removed

    def close(self) -> None:
        """The job ended cleanly: remove this engine's files (manifests first)."""
        mine = [f for f in own_files(self.shm_dir, self.job_id, self.node, self.rank) if f.token == self.token]
        for f in sorted(mine, key=lambda f: f.kind != "own_json"):
            unlink_quiet(os.path.join(self.shm_dir, f.name))


# --- readers (the node agent, the respawned worker) ----------------------------------------------------
@dataclass(frozen=True)
class OwnImage:
    """A committed own image found in ``shm_dir``: its manifest and payload file."""

    manifest: Manifest
    payload: str


def candidates(shm_dir: str, job_id: str, node: str | None, rank: int) -> list[OwnImage]:
    """Own images of ``rank`` whose manifest parses and names this job and rank, newest first.

    Only parsed, not checksummed: see :func:`verify`.
    """
    found = []
    for f in own_files(shm_dir, job_id, node, rank):
        if f.kind != "own_json" or f.tmp:
            continue
        path = os.path.join(shm_dir, f.name)
        try:
            with open(path, "rb") as fh:
                m = Manifest.from_bytes(fh.read())
        except (OSError, ManifestError) as exc:
            log.warning("own image manifest %s unreadable: %s", path, exc)
            continue
        if m.job_id != job_id or m.owner != rank:
            log.warning("own image manifest %s names job %r rank %d: ignored", path, m.job_id, m.owner)
            continue
        found.append(OwnImage(m, path[: -len(".json")] + ".bin"))
    return sorted(found, key=lambda i: (i.manifest.generation, i.manifest.version), reverse=True)


def _map(img: OwnImage) -> torch.Tensor:
    """A read-only view (private mapping: this process never writes the file) of the payload."""
    total = img.manifest.total_bytes
    size = os.stat(img.payload).st_size
    if size < total:
        raise NodeLocalImageError(f"{img.payload}: {size} bytes, the manifest wants {total}")
    if total == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(img.payload, shared=False, size=total, dtype=torch.uint8)


def verify(img: OwnImage) -> torch.Tensor:
    """Map ``img``'s payload and check every chunk; raises :class:`NodeLocalImageError`."""
    try:
        buf = _map(img)
    except (OSError, RuntimeError) as exc:
        raise NodeLocalImageError(f"{img.payload}: cannot map: {exc}") from exc
    m = img.manifest
    bad = bad_chunks(buf, m.chunk_bytes, list(m.chunk_checksums), m.total_bytes)
    if bad:
        raise NodeLocalImageError(f"own image of rank {m.owner} v{m.version} in {img.payload}: "
                                  f"{len(bad)} corrupt chunk(s) of {len(m.chunk_checksums)}: {bad[:8]}")
    return buf


def newest_verified(shm_dir: str, job_id: str, node: str | None, rank: int) -> Manifest | None:
    """The manifest of the newest own image of ``rank`` on this node whose checksums all match now.

    What an agent reports for a dead worker. Never raises for a bad file: a
    missing, unreadable or corrupt image is logged and skipped.
    """
    for img in candidates(shm_dir, job_id, node, rank):
        try:
            verify(img)
        except NodeLocalImageError as exc:
            log.warning("%s", exc)
            continue
        return img.manifest
    return None


def open_verified(shm_dir: str, job_id: str, node: str | None, rank: int, version: int,
                  n_chunks: int, generation: int) -> tuple[Manifest, torch.Tensor]:
    """The own image the plan named (``version``, ``n_chunks``, ``generation``), mapped and re-verified.

    Raises :class:`NodeLocalImageError` when it is gone, differs from what the
    agent reported, or a checksum fails: the caller reports a failed restore
    and the re-plan pulls the image from peers.
    """
    hits = [i for i in candidates(shm_dir, job_id, node, rank)
            if (i.manifest.version, i.manifest.generation, len(i.manifest.chunk_checksums))
            == (version, generation, n_chunks)]
    if not hits:
        raise NodeLocalImageError(f"no node-local own image of rank {rank} v{version} (generation {generation}, "
                                  f"{n_chunks} chunks) in {shm_dir}")
    return hits[0].manifest, verify(hits[0])


def discard_newer(shm_dir: str, job_id: str, node: str | None, rank: int, version: int) -> list[str]:
    """After resuming at ``version``: forget own images newer than it (a timeline being replayed)."""
    removed = []
    for img in candidates(shm_dir, job_id, node, rank):
        if img.manifest.version > version:
            path = img.payload[: -len(".bin")] + ".json"
            if unlink_quiet(path):
                removed.append(path)
    return removed
