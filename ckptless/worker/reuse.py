"""What a recovery can reuse instead of redoing: the restored image and the retired engine's buffers.

Why: after the state is restored, the first step must wait only for what it
needs. Two costs used to sit there that are not the missing bytes:

* **Capturing the resume version again.** The state was just loaded from an
  image, byte for byte. That image (the survivor's own committed copy, or the
  replacement's received one) *is* a capture of the resume version, so it is
  mirrored as is, with its manifest re-stamped to the new generation, instead
  of copying and checksumming S bytes again on the training thread.
* **Fresh buffers.** A new engine's pool used to allocate its capture buffers
  on first use; the first touch of S fresh bytes costs page faults (about
  0.12 s per 256 MiB on the reference machine) on the first steps after a
  recovery. The previous generation's engine had buffers of the same size,
  already faulted in: once its thread has ended they are handed over.

Not reused, captured as before: a state loaded from disk, the initial state
(R0), a node-local restore, and every image when the pool lives in shm files
(the node-local tier keeps a manifest file beside each buffer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ckptless.mirror import MirrorEngine
from ckptless.mirror import PairSpec
from ckptless.mirror import StoredImage
from ckptless.state import StateImage
from ckptless.worker.generation import release_retired_buffers, retired_engines_left, take_retired_buffers


def mirror_restored(engine: MirrorEngine | None, image: StateImage | None, version: int, owner: int, job_id: str,
                    generation: int, pairs: PairSpec) -> bool:
    """Mirror the image the state was restored from as ``version`` of ``owner`` in ``generation``;
    False when it must be captured.

    ``image`` must hold exactly the bytes the protected objects were just
    loaded from (:class:`~ckptless.recovery.executor.RestoreOutcome.image`).
    The engine adopts its buffer into its pool; the caller must not reuse it.
    """
    if engine is None or image is None or engine.own_files is not None:  # node-local tier: file-backed pool
        return False
    m = image.manifest
    if m.version != version or m.owner != owner or m.job_id != job_id:
        return False
    engine.submit(dataclasses.replace(m, generation=generation), image.buffer[: m.total_bytes], pairs)
    return True


def donate_retired(own_images: Sequence[StoredImage], engine: MirrorEngine) -> None:
    """Fill ``engine``'s pool with retired engines' free buffers; release the rest.

    Called on every capture while a retired engine is left, so the buffers and the
    mirror group of a thread that ended late are released then (not at the next
    recovery).
    ``own_images`` (kept for a restore) keep their buffers.
    """
    if not retired_engines_left():
        return
    room = engine.config.pool_buffers - len(engine.pool_ptrs())
    if room > 0 and engine.own_files is None:
        in_use = set(engine.pool_ptrs()) | {img.buffer.data_ptr() for img in own_images}
        engine.donate(take_retired_buffers(room, in_use))
    release_retired_buffers()


__all__ = ["donate_retired", "mirror_restored"]
