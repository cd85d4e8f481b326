"""A digest of every protected object, written by the library itself when a chaos runner asks.

Why: "a run with failures ends bitwise identical to the same run without them"
must be checkable on *any* script that uses ``ckptless.init/protect/run``,
without the script writing its final state itself. The runner sets
``CKPTLESS_DIGEST_DIR``; at ``job.close()`` each rank writes
``digest_rank<R>.json`` with one SHA-256 per protected object (RNG streams
included) over its exact state: the typed tree of non-tensor values and the
raw bytes of every tensor (DTensor: its local shard). Two runs are bitwise
equal exactly when every rank's digests are equal. A script that forgets to
protect its data position replays other batches after a recovery, so its
model digest differs: the verdict FAILs, as it must.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch

from ckptless import environment
from ckptless.state.registry import StateRegistry
from ckptless.state.tree import encode


def object_digest(state: Any) -> str:
    tree, tensors = encode(state)
    h = hashlib.sha256(json.dumps(tree, sort_keys=True, separators=(",", ":")).encode())
    for t in tensors:
        local = t.detach()
        if local.device.type != "cpu":
            local = local.cpu()
        h.update(str(local.dtype).encode())
        h.update(str(tuple(local.shape)).encode())
        # reshape(-1): a 0-dim tensor (an optimizer's `step`) cannot be viewed as bytes directly
        h.update(local.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if local.numel() else b"")
    return h.hexdigest()


def registry_digest(registry: StateRegistry) -> dict[str, str]:
    return {name: object_digest(obj.state_dict()) for name, obj in registry.items()}


def write_digest(registry: StateRegistry, rank: int, step: int, directory: str | None = None,
                 name: str = "digest") -> str | None:
    """Write ``<name>_rank<R>.json`` if a runner asked for it (``CKPTLESS_DIGEST_DIR``); returns the path.

    ``name`` ``"init"``: the state a first-generation rank starts training from (a runner compares
    two runs' initial states first: an unseeded script never started from the same state)."""
    d = directory if directory is not None else environment.current().digest_dir
    if not d:
        return None
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, f"{name}_rank{rank}.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"rank": rank, "step": step, "objects": registry_digest(registry)}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path
