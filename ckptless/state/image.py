"""The state image type and the buffer helpers shared by capture and restore.

Kept apart from :mod:`ckptless.state.capture` so that restore (which capture
re-exports for compatibility) can use them without an import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ckptless.errors import StateError
from ckptless.state.manifest import Manifest, TensorEntry

if TYPE_CHECKING:
    from ckptless.state.fence import CopyFence
    from ckptless.state.live_prefix import LivePrefix


@dataclass
class StateImage:
    """One captured version of a rank's state: manifest plus raw bytes.

    ``buffer`` is a 1-D contiguous uint8 CPU tensor of at least
    ``manifest.total_bytes`` bytes (it may be a larger reused buffer; only the
    first ``total_bytes`` are part of the image).

    ``fence``: device-to-host copies still in flight into ``buffer`` (an
    asynchronous capture, :mod:`ckptless.state.fence`); None when the bytes
    are final.

    ``live``: a deferred capture's replicated prefix, still in the live tensors
    (:mod:`ckptless.state.live_prefix`); ``buffer`` then holds the image's bytes
    from ``live.nbytes`` on. None: ``buffer`` holds the whole image.
    """

    manifest: Manifest
    buffer: torch.Tensor
    fence: CopyFence | None = None
    live: LivePrefix | None = None


def check_buffer(buf: torch.Tensor, what: str) -> None:
    """Raise :class:`StateError` unless ``buf`` is a 1-D contiguous uint8 CPU tensor."""
    if (
        not isinstance(buf, torch.Tensor)
        or buf.dtype != torch.uint8
        or buf.dim() != 1
        or not buf.is_contiguous()
        or buf.device.type != "cpu"
    ):
        raise StateError(f"{what} must be a 1-D contiguous uint8 CPU tensor")


def slot(buf: torch.Tensor, entry: TensorEntry, dtype: torch.dtype) -> torch.Tensor:
    """View of ``buf`` where ``entry``'s tensor lives, with its dtype and shape (no copy)."""
    return buf[entry.offset : entry.offset + entry.nbytes].view(dtype).view(entry.shape)
