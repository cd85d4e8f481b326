"""Host buffers the GPU can copy into without the CPU: page-locked ("pinned") memory.

Why: a device-to-host copy into ordinary (pageable) memory is staged by the
CUDA driver and returns only when it is done, so a capture into pageable
buffers blocks the training thread for the whole copy, whatever stream it is
queued on. Into page-locked memory the copy is a DMA the GPU runs on its own.
The capture pool is reused for the whole job, so locking its pages once pays
for itself on the second capture.

Two kinds of buffer, two ways:

* anonymous buffers are allocated page-locked (``pin_memory=True``: torch's
  caching host allocator owns them and frees them normally);
* buffers that must be *files* (the node-local tier's ``/dev/shm`` pool,
  which outlives the process) are mapped first and then registered with
  ``cudaHostRegister``; their owner (the mirror engine) unregisters them
  before it drops them (:func:`unregister`). Both copies then run at PCIe
  speed and neither tier is given up for the other.

Only a process that already uses CUDA pins anything: locking pages would
create a CUDA context (hundreds of MiB of GPU memory) in a CPU job that
merely runs on a GPU host. A failed pin (the lockable memory is exhausted)
is one warning; the buffer stays pageable: slower, never wrong.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

import torch

from ckptless.state import devices

log = logging.getLogger(__name__)

_lock = threading.Lock()
_registered: dict[int, int] = {}  # data_ptr -> bytes, buffers this process registered
_warned: list[str] = []
REGISTER_TIMEOUT_S = 300.0  # page-locking runs at GB/s; a registration that takes longer is given up on


def uses_cuda() -> bool:
    """This process has a CUDA context already (it trains on a GPU); never creates one."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


@contextlib.contextmanager
def _on_home() -> Iterator[None]:
    """On the rank's own GPU: pinned memory is allocated in the calling thread's context, and a thread
    that never set its device would make one on GPU 0, a neighbour's (hundreds of MiB)."""
    home = devices.home()
    if home is None:
        yield
    else:
        with torch.cuda.device(home):
            yield


def _warn_once(what: str, exc: BaseException | str) -> None:
    if not _warned:
        _warned.append(what)
        log.warning("could not page-lock %s (%s): the capture's copies into it wait for the GPU", what, exc)


def empty(nbytes: int) -> torch.Tensor:
    """A 1-D uint8 host buffer, page-locked when this process uses CUDA.

    torch's pinned allocator rounds a block up to a power of two and caches freed blocks, so an
    anonymous pinned buffer may hold up to twice its bytes (the node-local tier's file buffers are
    registered at their exact size instead: :func:`register`)."""
    if uses_cuda():
        try:
            with _on_home():
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError as exc:
            _warn_once(f"a {nbytes}-byte buffer", exc)
    return torch.empty(nbytes, dtype=torch.uint8)


def _cudart_on_home_thread(call: Callable[[], int], what: str) -> int | None:
    """Run one CUDA runtime call on a short-lived thread bound to the home GPU; its error code, or None
    when it did not return in time. Why a thread: a failed CUDA runtime call leaves the calling thread's
    last-error state set, which torch's next kernel-launch check on that thread would raise as a
    device error (the training thread's next step); a thread of its own takes it away with it."""
    out: list[int] = []

    def run() -> None:
        home = devices.home()
        if home is not None:
            torch.cuda.set_device(home)
        out.append(int(call()))

    t = threading.Thread(target=run, name=f"ckptless-{what}", daemon=True)
    t.start()
    t.join(REGISTER_TIMEOUT_S)
    return out[0] if out else None


def register(t: torch.Tensor) -> bool:
    """Page-lock an existing buffer in place (``cudaHostRegister``); True if it now is (or was)."""
    if not uses_cuda() or t.numel() == 0:
        return False
    ptr, n = t.data_ptr(), t.numel() * t.element_size()
    with _lock:
        if ptr in _registered:
            return True
        err = _cudart_on_home_thread(lambda: torch.cuda.cudart().cudaHostRegister(ptr, n, 1), "register")
        if err != 0:  # 1: cudaHostRegisterPortable (every context sees it as pinned)
            _warn_once(f"a {n}-byte mapped buffer", f"cudaHostRegister error {err}" if err is not None
                       else f"cudaHostRegister did not return within {REGISTER_TIMEOUT_S:.0f}s")
            return False
        _registered[ptr] = n
    return True


def unregister(t: torch.Tensor) -> None:
    """Undo :func:`register` (a no-op for a buffer this process did not register). Call it before
    the buffer is dropped, once no copy into it is in flight."""
    ptr = t.data_ptr()
    with _lock:
        if _registered.pop(ptr, None) is None:
            return
        err = _cudart_on_home_thread(lambda: torch.cuda.cudart().cudaHostUnregister(ptr), "unregister")
    if err != 0:
        log.warning("cudaHostUnregister of a capture buffer failed (%s)", err)


def pinned(t: torch.Tensor) -> bool:
    """Is ``t`` page-locked (allocated so, or registered)? Never creates a CUDA context."""
    if not uses_cuda():
        return False
    with _lock:
        if t.data_ptr() in _registered:
            return True
    with _on_home():
        return bool(t.is_pinned())


def registered_bytes() -> int:
    """Bytes this process holds registered (a leak shows here: tests on a GPU check it)."""
    with _lock:
        return sum(_registered.values())
