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

Code outside this package imports what it uses from here, never from a module of it
(tests/unit/test_structure.py): the names below are the package's whole surface.
"""

from ckptless.state import checksum, devices, host_memory, streams
from ckptless.state.capture import ALIGN, Capturer, Plan
from ckptless.state.checksum import DEFAULT_CHUNK_BYTES, bad_chunks, chunk_checksums, crc_of
from ckptless.state.ddp import HIDDEN_PREFIX, DDPReducerState
from ckptless.state.digest import write_digest
from ckptless.state.dtensor import is_dtensor, local_of
from ckptless.state.fence import CopyFence, WriteOrder
from ckptless.state.image import StateImage, slot
from ckptless.state.layout import manifest_layout_key
from ckptless.state.live_prefix import LivePrefix
from ckptless.state.local_groups import AnswersLocally
from ckptless.state.manifest import Manifest, TensorEntry, dtype_from_name
from ckptless.state.registry import RNG_NAME, Stateful, StateRegistry, is_hidden
from ckptless.state.replication import (
    Region, ReplicaSet, bad_held_chunks, first_held_chunk, held_bytes, held_from, of_dtensors, prefix_chunks, region_of)
from ckptless.state.restore import ObjectRestore, RestoreReport, object_subtrees, restore, tensor_indices
from ckptless.state.rng import RNGState, numpy_from_tree, numpy_tree, python_from_tree, python_tree
from ckptless.state.tree import decode, encode, tensor_paths_of
from ckptless.state import window
from ckptless.state.window import GradientWindow, clear_grads

__all__ = [
    "ALIGN", "AnswersLocally", "Capturer", "CopyFence", "DDPReducerState", "DEFAULT_CHUNK_BYTES", "GradientWindow", "HIDDEN_PREFIX",
    "LivePrefix", "Manifest", "ObjectRestore", "Plan", "RNGState", "RNG_NAME", "Region", "ReplicaSet", "RestoreReport",
    "StateImage", "StateRegistry", "Stateful", "TensorEntry", "WriteOrder", "bad_chunks", "bad_held_chunks",
    "checksum", "chunk_checksums", "clear_grads", "crc_of", "decode", "devices", "dtype_from_name", "encode", "first_held_chunk",
    "held_bytes", "held_from", "host_memory", "is_dtensor", "is_hidden", "local_of", "manifest_layout_key",
    "numpy_from_tree", "numpy_tree", "object_subtrees", "of_dtensors", "prefix_chunks", "python_from_tree",
    "python_tree", "region_of", "restore", "slot", "streams", "tensor_indices", "tensor_paths_of", "window", "write_digest",
]
