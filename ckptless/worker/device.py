"""The rank's own GPU and the backend of its CUDA collectives, decided once in ``ckptless.init()``.

Why here and not in the user's script: three things depend on one answer to
"which GPU is this rank's?", and they must agree in every incarnation of the
rank: the device its NCCL communicators are bound to (formed eagerly, inside
the abortable formation: :mod:`ckptless.worker.nccl`), the device an image's
GPU tensors are restored onto when no live tensor says
(:func:`ckptless.state.devices.target`: the *current* device), and the CUDA
generator the RNG state is saved from and restored into (the current
device's). The agent gives each worker its own GPU in ``LOCAL_RANK``
(torchrun's convention; a spare gets a free GPU of its node:
``launcher/devices.py``), so ``init()`` makes ``cuda:LOCAL_RANK`` current, as
nearly every torchrun script does first anyway.

The CUDA backend (``CKPTLESS_CUDA_BACKEND``):

* ``nccl`` (the default where CUDA is available): NCCL communicators bound to
  the rank's GPU. NCCL refuses two ranks of one communicator on one GPU, so a
  rank without a GPU of its own is refused here, with the way out.
* ``gloo``: CUDA tensors go through Gloo. Ranks may then share a GPU: this is
  how a multi-process job is recovered on a one-GPU machine (``make
  test-gpu``); slow, and only for that.
* ``none``: no CUDA communicator and no CUDA context is made (a CPU job on a
  GPU host).
"""

from __future__ import annotations

import logging
from typing import Literal

import torch

from ckptless import environment
from ckptless.errors import ConfigError
from ckptless.state import devices

log = logging.getLogger(__name__)

CudaBackend = Literal["nccl", "gloo", "none"]

_bound: dict[str, object] = {"device": None, "backend": "none"}


def cuda_backend(chosen: CudaBackend | None = None) -> CudaBackend:
    """The backend of this process's CUDA collectives (see the module doc); ``chosen``: the value of
    ``CKPTLESS_CUDA_BACKEND`` when not this process's own environment's."""
    chosen = chosen if chosen is not None else environment.current().cuda_backend
    if chosen is not None:
        return chosen
    return "nccl" if torch.cuda.is_available() else "none"


def choose(local_rank: int, n_gpus: int, backend: CudaBackend) -> int | None:
    """The GPU index of a worker (pure): ``cuda:LOCAL_RANK``; None without a CUDA backend.

    With NCCL a rank needs a GPU of its own (:class:`ConfigError` otherwise); with Gloo ranks may
    share one (index ``LOCAL_RANK`` modulo the GPUs seen)."""
    if backend == "none":
        return None
    if n_gpus <= 0:
        raise ConfigError("CKPTLESS_CUDA_BACKEND", backend, "this process sees no CUDA device (set "
                          "CKPTLESS_CUDA_BACKEND=none for a CPU job)")
    if backend == "gloo":
        return local_rank % n_gpus
    if not 0 <= local_rank < n_gpus:
        raise ConfigError("LOCAL_RANK", local_rank,
                          f"this worker sees {n_gpus} GPU(s), and NCCL needs a GPU of its own for each rank: start "
                          "at most one worker per GPU (spares on a spare node when the node is full: --nproc-per-node "
                          "0 --spares N), or set CKPTLESS_CUDA_BACKEND=none for a CPU job on a GPU host")
    return local_rank


def bind(local_rank: int, chosen: CudaBackend | None = None) -> torch.device | None:
    """Make the rank's GPU current and every thread's home (``state.devices``), once per process;
    returns it, or None for a job without CUDA. (torch's NCCL settings, ``TORCH_NCCL_NONBLOCKING_TIMEOUT``
    among them, are given by :mod:`ckptless.worker.nccl_env` before the first communicator.)"""
    backend = cuda_backend(chosen)
    n = torch.cuda.device_count() if backend != "none" else 0
    index = choose(local_rank, n, backend)
    _bound["backend"] = backend
    if index is None:
        _bound["device"] = None
        devices.set_home(None)
        return None
    dev = torch.device("cuda", index)
    torch.cuda.set_device(dev)
    _bound["device"] = dev
    devices.set_home(dev)
    log.info("rank's GPU: %s (CUDA collectives: %s)", dev, backend)
    return dev


def bound() -> torch.device | None:
    """The GPU :func:`bind` made current (None: no CUDA backend, or not bound yet)."""
    dev = _bound["device"]
    return dev if isinstance(dev, torch.device) else None


def bound_backend() -> CudaBackend:
    b = _bound["backend"]
    return "nccl" if b == "nccl" else "gloo" if b == "gloo" else "none"
