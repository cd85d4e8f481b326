"""The ``/dev/shm`` files behind one holder's replica slots: a payload file and a manifest file per slot.

Why ``/dev/shm`` backing at all: a file-backed tensor survives the holder's
own process crash, so a respawned holder re-attaches its replicas
(:mod:`ckptless.mirror.reattach`) instead of losing them. The payload is
written first; the manifest JSON beside it is written (atomically) only after
the payload verified, and removed before a slot is rewritten, so a crash
mid-write never leaves a manifest that lies. Files are named by (job, node,
owner, holder, slot) (:mod:`ckptless.mirror.shm`): holders of one owner that
share a host never share a file. A slot whose pages the directory cannot
reserve (ENOSPC) is held in memory instead, with one warning: the round still
commits, only that replica would not outlive this process (issue 17: a full
``/dev/shm`` made every round time out, forever).

Why a module of its own: the store's rules (which slot is written, which image
is newest, what is pinned, when a verdict is stale) are the same whether a
slot's bytes sit in memory or in a file. Only this part knows paths, page
reservations and manifest files; the store (:mod:`ckptless.mirror.store`)
asks it for a mapping and tells it when a slot completed or was forgotten.
"""

from __future__ import annotations

import os

import torch

from ckptless.mirror.shm import (
    FallbackNotice, ShmFile, holder_files, reserve_mapping, slot_path, stat_signature, unlink_quiet,
)
from ckptless.state import Manifest


class SlotFiles:
    """The files of one holder identity (job, node, holder) in ``shm_dir``.

    ``fallback`` says (once) that a slot or a manifest did not fit and stays in
    memory only. Creates ``shm_dir`` if needed; removes nothing by itself.
    """

    def __init__(self, shm_dir: str, job_id: str, node: str | None, holder: int, fallback: FallbackNotice) -> None:
        self.shm_dir, self.job_id, self.node, self.holder = shm_dir, job_id, node, holder
        self.fallback = fallback
        os.makedirs(shm_dir, exist_ok=True)

    def path(self, owner: int, slot: int, ext: str) -> str:
        return slot_path(self.shm_dir, self.job_id, self.node, owner, self.holder, slot, ext)

    def existing(self) -> list[ShmFile]:
        """This identity's files now in the directory, temp files included."""
        return holder_files(self.shm_dir, self.job_id, self.node, self.holder)

    def unlink_all(self) -> None:
        """Delete every file of this identity (a fresh store, or the job finished)."""
        for f in self.existing():
            unlink_quiet(os.path.join(self.shm_dir, f.name))

    def reserve(self, owner: int, slot: int, nbytes: int) -> torch.Tensor | None:
        """The slot's payload file mapped with ``nbytes`` of reserved pages; None if they cannot be
        (full: ENOSPC, or the file cannot be mapped): the file is removed, the fallback reported, and
        the caller keeps this replica in memory."""
        path = self.path(owner, slot, "bin")
        try:
            return reserve_mapping(path, nbytes)
        except (OSError, RuntimeError) as exc:
            unlink_quiet(path)
            self.fallback.report(f"replica of owner {owner}", nbytes, exc)
            return None

    def stat(self, owner: int, slot: int) -> tuple[int, int, int, int] | None:
        """The payload file's stat signature (what an at-rest verdict is about)."""
        return stat_signature(self.path(owner, slot, "bin"))

    def record(self, owner: int, slot: int, m: Manifest) -> None:
        """Write the slot's manifest file; a full directory costs only the re-attach, never the round.

        The temp name is this holder's own (the path is), so two holders of
        one owner never rename each other's file away (issue 8).
        """
        path = self.path(owner, slot, "json")
        tmp = path + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(m.to_bytes())
            os.replace(tmp, path)
        except OSError as exc:
            unlink_quiet(tmp)
            self.fallback.report(f"manifest of owner {owner}'s replica v{m.version}", len(m.to_bytes()), exc)

    def forget(self, owner: int, slot: int) -> None:
        """Remove the slot's manifest file: its payload is being rewritten or was dropped."""
        unlink_quiet(self.path(owner, slot, "json"))
