"""The process-global random streams as one ``Stateful``.

Why: a restored run must draw exactly the numbers the uninterrupted run would
have drawn (dropout masks, augmentation, shuffles), so every global generator
a training step may touch is captured with the rest of the state: Python's
``random``, NumPy's legacy global ``RandomState`` (what ``np.random.rand``
uses), torch's CPU generator, and the CUDA generator of *the rank's own GPU*
(the current device, which ``ckptless.init()`` sets). Generators the user
creates (``torch.Generator``, ``np.random.default_rng``) are their own state:
protect the objects owning them.

Why the rank's own device and not every device: a rank draws its dropout
masks from its own GPU's generator. Saved by device index (what
``get_rng_state_all`` gives), a rank restored on another GPU (a spare on
GPU 5 taking the rank that ran on GPU 3) would set GPU 3's generator and draw
from GPU 5's, another stream, and a process that sees another number of
GPUs could not restore at all. So the image holds one CUDA state, restored
into the current device's generator wherever that is. A process that never
touched CUDA saves none (reading it would create a CUDA context in a CPU job
on a GPU host). Images with one state per device (written before this rule)
still restore where the device count matches.

The large state vectors are stored as int64 tensors, not JSON lists, so they
travel in the raw buffer instead of bloating the manifest.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from ckptless.errors import StateError
from ckptless.state import devices

_KEYS = {"python", "numpy", "torch", "cuda"}


def python_tree(state: tuple[Any, ...]) -> dict[str, Any]:
    """``random.getstate()`` as an image holds it: its 625 words as one tensor (images hold no tuples)."""
    version, internal, gauss = state
    return {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss}


def python_from_tree(tree: dict[str, Any]) -> tuple[Any, ...]:
    return int(tree["version"]), tuple(int(x) for x in tree["state"].tolist()), tree["gauss"]


def numpy_tree(state: Any) -> dict[str, Any]:
    """NumPy's legacy ``get_state()`` as an image holds it."""
    name, key, pos, has_gauss, cached = state
    return {"name": str(name), "key": torch.from_numpy(np.asarray(key, dtype=np.int64)), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def numpy_from_tree(tree: dict[str, Any]) -> tuple[Any, ...]:
    return (str(tree["name"]), np.asarray(tree["key"].numpy(), dtype=np.uint32), int(tree["pos"]),
            int(tree["has_gauss"]), float(tree["cached_gaussian"]))


class RNGState:
    """``Stateful`` snapshot/restore of all process-global generators.

    The CUDA path runs only in a process that initialised CUDA; the CPU suite does not
    exercise it (``make test-gpu`` does, across processes and devices).
    """

    def state_dict(self) -> dict[str, Any]:
        cuda: list[torch.Tensor] = []
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            own = devices.home()
            cuda = [torch.cuda.get_rng_state(own if own is not None else torch.cuda.current_device())]
        return {
            "python": python_tree(random.getstate()),
            "numpy": numpy_tree(np.random.get_state(legacy=True)),
            "torch": torch.get_rng_state(),
            "cuda": cuda,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or set(state) != _KEYS:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise StateError(f"RNG state must have keys {sorted(_KEYS)}, got {got}")
        try:
            py_state = python_from_tree(state["python"])
            np_state = numpy_from_tree(state["numpy"])
            torch_state = state["torch"]
            cuda = list(state["cuda"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise StateError(f"malformed RNG state: {exc}") from exc
        if cuda:
            self._check_cuda(len(cuda))
        # One state: the rank's own device's generator, set on this process's current device.
        # Everything is parsed above before any generator is touched, so a
        # malformed state leaves the process's streams as they were.
        try:
            random.setstate(py_state)
            np.random.set_state(np_state)
            torch.set_rng_state(torch_state)
            if len(cuda) == 1:
                own = devices.home()
                torch.cuda.set_rng_state(cuda[0], own if own is not None else torch.cuda.current_device())
            elif cuda:  # an image with one state per device: only where the count matches (checked above)
                torch.cuda.set_rng_state_all(cuda)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise StateError(f"could not restore RNG state: {exc}") from exc

    @staticmethod
    def _check_cuda(n: int) -> None:
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have == 0:
            raise StateError("RNG state holds a CUDA generator (a GPU rank's) but this process sees no CUDA device")
        if n > 1 and have != n:
            raise StateError(f"RNG state holds {n} CUDA generators (one per device, an older image) but this "
                             f"process sees {have} CUDA device(s)")
