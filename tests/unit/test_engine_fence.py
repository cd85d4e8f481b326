"""The mirror engine and an asynchronous capture's fence: two engines on a real Gloo pair, one process.

The engine must not read an image before its capture's copies are done, and must never mirror an
image its fence calls torn (a write raced the copy): it breaks instead (a fault, the job rolls back),
and the torn buffer is not offered as an own image for a rollback.
"""

from __future__ import annotations

import threading

import pytest
import torch

from ckptless.errors import MirrorError
from ckptless.state.fence import CopyFence

from ..harness.mirror import engine_pair, fill


class SlowMarker:
    """Done once ``release`` is set (the GPU finishing the copy)."""

    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def done(self) -> bool:
        return self.release.is_set()

    def order_current(self) -> None:
        pass


def test_a_round_waits_for_the_copies_and_a_torn_image_breaks_the_engine() -> None:
    e0, e1 = engine_pair("fence", 5.0)
    try:
        release = threading.Event()
        source = torch.zeros(4)
        m0, b0 = fill(e0, 1, 4096, job="fence")
        m1, b1 = fill(e1, 1, 4096, job="fence")
        slow = CopyFence([SlowMarker(release)], [SlowMarker(release)], [(0, source, source._version)])
        e0.submit(m0, b0, fence=slow)
        e1.submit(m1, b1)
        assert not e0.wait_committed(1, timeout=0.3)  # the copies are not done: nothing is read yet
        release.set()
        assert e0.wait_committed(1, timeout=10) and e1.wait_committed(1, timeout=10)

        # Version 2: a write to a watched source before the copy was ordered tears the image.
        torn = threading.Event()
        torn.set()
        m0, b0 = fill(e0, 2, 4096, job="fence")
        m1, b1 = fill(e1, 2, 4096, job="fence")
        fence = CopyFence([SlowMarker(torn)], [SlowMarker(torn)], [(0, source, source._version)])
        source.add_(1)
        e0.submit(m0, b0, fence=fence)
        e1.submit(m1, b1)
        with pytest.raises(MirrorError, match="is not mirrored"):
            e0.wait_idle(10)  # wakes as soon as the round breaks the engine
        assert e0.broken and "is not mirrored" in str(e0.error) and "written in place" in str(e0.error)
        assert [img.manifest.version for img in e0.own_images()] == [1]  # never offered for a rollback
        assert e0.committed_version == 1
    finally:
        for e in (e0, e1):
            e.retire()
