"""ckptless.state: capture of training state into flat checksummed CPU buffers, and exact restore.

Public API::

    reg = StateRegistry()                      # RNG streams included as "rng"
    reg.protect(model=model, optimizer=opt, scheduler=sched, data=loader)
    cap = Capturer(reg, job_id="job", owner=rank)
    img = cap.capture(version=step, generation=gen, out=buf)   # StateImage
    report = restore(reg, img)                 # verifies checksums first; in place where exact

DDP and FSDP2 models (see ckptless.state.ddp, ckptless.state.fsdp)::

    reg.protect(model=ddp_or_fully_sharded_model, optimizer=opt)   # before the first step
    reg.step_done()                            # after every completed step
    reg.reset_after_failure()                  # survivor: after groups.release_all(), before restoring
    with ckptless.worker.groups.local_only():  # DDP state replays collectives: keep them local
        restore(reg, img)
"""

from ckptless.state.capture import ALIGN, Capturer
from ckptless.state.checksum import DEFAULT_CHUNK_BYTES
from ckptless.state.image import StateImage
from ckptless.state.manifest import Manifest, TensorEntry
from ckptless.state.registry import RNG_NAME, Stateful, StateRegistry
from ckptless.state.restore import ObjectRestore, RestoreReport, restore
from ckptless.state.rng import RNGState
from ckptless.state.tree import decode, encode

__all__ = [
    "ALIGN",
    "Capturer",
    "DEFAULT_CHUNK_BYTES",
    "Manifest",
    "ObjectRestore",
    "RNGState",
    "RNG_NAME",
    "RestoreReport",
    "StateImage",
    "StateRegistry",
    "Stateful",
    "TensorEntry",
    "decode",
    "encode",
    "restore",
]
