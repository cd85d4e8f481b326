"""The capture pool's memory: page-locked where the GPU copies into it, and never dropped under a copy.

Why a module of its own: the engine (:mod:`ckptless.mirror.mirror`) decides
*which* buffer holds what; this module decides what a buffer *is*. A GPU job
captures with asynchronous device-to-host copies (:mod:`ckptless.state.fence`),
which only run without the CPU into page-locked memory, so:

* an anonymous pool buffer is allocated page-locked (when the process uses
  CUDA: :func:`ckptless.state.host_memory.empty`);
* a node-local tier buffer (a file in ``/dev/shm``, which must outlive the
  process) is mapped and then registered (``cudaHostRegister``), so the tier
  and the fast copy are not a choice;
* a registered buffer is unregistered before the engine drops it, and any
  buffer is dropped only once the copies into it are done (:func:`drop`):
  freeing or unregistering memory under a DMA is undefined.

The cost is the pinning itself, once per buffer, on the first capture of a
pool (as the page faults it replaces); after that the pool is reused.
"""

from __future__ import annotations

import logging

import torch

from ckptless.errors import DeviceTimeout
from ckptless.mirror.ownimage import OwnImageFiles
from ckptless.state import host_memory
from ckptless.state import CopyFence

log = logging.getLogger(__name__)


def allocate(own_files: OwnImageFiles | None, nbytes: int) -> tuple[torch.Tensor, str | None]:
    """A pool buffer of ``nbytes``: a page-locked anonymous one, or a registered file of the tier."""
    if own_files is None:
        return host_memory.empty(nbytes), None
    tensor, path = own_files.allocate(nbytes)
    if path is not None:
        host_memory.register(tensor)
    return tensor, path


def drop(tensor: torch.Tensor, path: str | None, fence: CopyFence | None, timeout_s: float) -> None:
    """Before the engine lets go of a buffer: the copies into it are done, then its registration ends.

    A copy that does not finish in time (a hung GPU) keeps the registration: a leak of locked
    pages is recoverable, unregistering under a running DMA is not."""
    if fence is not None:
        try:
            fence.wait(timeout_s, "copies into a capture buffer being dropped")
        except DeviceTimeout as exc:
            log.warning("%s: the buffer stays registered", exc)
            return
    if path is not None:
        host_memory.unregister(tensor)
