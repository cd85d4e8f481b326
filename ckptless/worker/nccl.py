# mypy: disable-error-code="attr-defined"
# (torch's CPU build, which type-checks this project, has no ProcessGroupNCCL in its stubs)
"""A generation's communicators for device tensors: formed eagerly, bound to the rank's GPU, abortable.

Why eager: NCCL builds a communicator lazily, at its first collective, unless
it is told its device. After a recovery that first collective is the user's
first step, outside the formation that a further failure can abandon: a peer
dying then hung the step, and every subgroup cost a full ``ncclCommInitRank``
inside the step. So each communicator is connected here, while its generation
forms (on the formation's helper thread, :func:`ckptless.worker.groups._abortable`):

* ``ProcessGroupNCCL`` with the rank's GPU (``eager_connect_single_device``),
  the collective timeout as NCCL's own (a backstop behind ckptless's
  detection), and **non-blocking** init (``config.blocking = 0``): a formation
  abandoned because a peer died aborts the communicator (``ncclCommAbort``
  ends an init in progress), where a blocking ``ncclCommInitRank`` cannot be
  interrupted at all.
* then one all-reduce of a one on the device, waited for on the same thread:
  it waits until the non-blocking init is really done, and checks that the
  communicator has every member (a communicator formed with fewer ranks than
  asked for would silently reduce over a part of the world: torchft saw one
  form with a single member when its cells reached NCCL at different times;
  here every rank has checked in at the store first, and the sum proves it).

Why not ``ncclCommSplit`` for subgroups (what torch does when the default
group has a bound device): the combination of non-blocking init, splits and
several threads crashes NCCL (NVIDIA/nccl#1605, open; torchft's recipe sets
blocking init to avoid it), and a blocking split cannot be aborted. Every
subgroup is therefore a communicator of its own (torchft's choice too);
docs/scale.md gives what that costs per generation.

Nothing here has run on several GPUs (NCCL refuses two ranks of one
communicator on one GPU, and no multi-GPU machine was lent): the same path
runs on CPU through a backend with NCCL's failure semantics
(``tests/harness/nccl_like.py``, which connects only when told to and so shows
a formation that forgets to), and ``make test-gpu`` runs world-1 NCCL groups.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion

from ckptless.errors import TransportError
from ckptless.state import streams

NCCL = dist.ProcessGroup.BackendType.NCCL

#: Whether a backend ckptless builds itself needs ``_set_sequence_number_for_group()``, as torch's own group
#: creation calls it up to 2.13. torch 2.14 stopped calling it and made it a deprecated no-op that writes a
#: warning to every process's stderr (c10d/Backend.hpp:556 of 2.14.1; docs/compatibility.md).
_SEQUENCE_NUMBERS_NEED_A_START = TorchVersion(torch.__version__) < "2.14"


def start_sequence_numbers(backend: Any) -> None:
    """What torch's own group creation does to a new Gloo or NCCL backend, on this torch."""
    if _SEQUENCE_NUMBERS_NEED_A_START:
        backend._set_sequence_number_for_group()


def build(store: dist.Store, rank: int, size: int, timeout: timedelta, name: str, global_ranks: list[int],
          device: torch.device, on_created: Callable[[Any], None] = lambda _: None) -> Any:
    """A ProcessGroupNCCL for ``device``, connected now (non-blocking init; see the module doc).
    ``on_created`` sees it before it connects: an abandoned formation can abort the connect."""
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    opts.config.blocking = 0
    opts.group_name = name  # type: ignore[assignment]
    opts.global_ranks_in_group = global_ranks
    backend = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, size, opts)
    start_sequence_numbers(backend)
    on_created(backend)
    connect(backend, device)
    return backend


def connect(backend: Any, device: torch.device) -> None:
    """Connect ``backend`` on ``device`` now, if it connects lazily (NCCL, the tests' NCCL-like one)."""
    eager = getattr(backend, "eager_connect_single_device", None)
    if callable(eager):
        eager(device)


def check_members(backend: Any, device: torch.device, size: int, what: str, timeout_s: float) -> None:
    """All-reduce a one over ``backend`` and wait for it, with a deadline, on the caller's thread (the
    formation's helper, which the formation abandons on an abort or its deadline); the sum must be
    ``size``. On a GPU the check runs on a stream of its own: a check that never completes (a peer
    that never came) must not block the device's default stream, which the training thread uses."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.SUM  # type: ignore[assignment]
    if device.type == "cuda":
        stream = torch.cuda.Stream(device=device)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            one = torch.ones(1, dtype=torch.int32, device=device)
            backend.allreduce([one], opts).wait()  # the check's stream waits for NCCL's, the CPU does not
            done = streams.EventMarker(device, stream)
        streams.wait([done], timeout_s, f"the member check of {what}")  # ends with the non-blocking init
    else:
        one = torch.ones(1, dtype=torch.int32)
        backend.allreduce([one], opts).wait()
    got = int(one.item())
    if got != size:
        raise TransportError(f"{what} formed with {got} of its {size} members: refusing it")
