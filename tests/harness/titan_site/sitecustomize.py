"""On PYTHONPATH of a test's workers: torchtitan's device pointed at the CPU before the script imports
torchtitan (tests/harness/titan_cpu.py says why), in the processes that set CKPTLESS_TEST_TITAN_CPU=1;
each worker its own NCCL_HOSTID where CKPTLESS_TEST_NCCL_HOSTID_PER_PROCESS=1 (several NCCL ranks on one GPU).
Chains to the sitecustomize it shadows, as ckptless-chaos's own does."""

import importlib.machinery as _machinery
import importlib.util as _util
import os as _os
import sys as _sys

if _os.getenv("CKPTLESS_TEST_TITAN_CPU") == "1" and _os.getenv("LOCAL_RANK") is not None:
    from tests.harness import titan_cpu as _titan_cpu

    _titan_cpu.use_cpu()

if _os.getenv("CKPTLESS_TEST_NCCL_HOSTID_PER_PROCESS") == "1" and _os.getenv("LOCAL_RANK") is not None:
    # several NCCL ranks on one GPU (tests/gpu/test_shared_gpu.py): each process its own NCCL host
    _os.environ["NCCL_HOSTID"] = f"ckptless-{_os.getpid()}"

# Only the entries after this one: one before it (ckptless-chaos's own) chains to this one already.
_here = _os.path.dirname(_os.path.abspath(__file__))
_at = [i for i, p in enumerate(_sys.path) if _os.path.abspath(p or ".") == _here]
_spec = _machinery.PathFinder.find_spec("sitecustomize", _sys.path[_at[0] + 1:] if _at else [])
if _spec is not None and _spec.loader is not None:
    _mod = _util.module_from_spec(_spec)
    _sys.modules["_titan_shadowed_sitecustomize"] = _mod
    _spec.loader.exec_module(_mod)
