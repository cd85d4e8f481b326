"""On PYTHONPATH of a test's workers: torchtitan's device pointed at the CPU before the script imports
torchtitan (tests/harness/titan_cpu.py says why), in the processes that set CKPTLESS_TEST_TITAN_CPU=1.
Chains to the sitecustomize it shadows, as ckptless-chaos's own does."""

import importlib.machinery as _machinery
import importlib.util as _util
import os as _os
import sys as _sys

if _os.getenv("CKPTLESS_TEST_TITAN_CPU") == "1" and _os.getenv("LOCAL_RANK") is not None:
    from tests.harness import titan_cpu as _titan_cpu

    _titan_cpu.use_cpu()

_here = _os.path.dirname(_os.path.abspath(__file__))
_spec = _machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in _sys.path if _os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:
    _mod = _util.module_from_spec(_spec)
    _sys.modules["_titan_shadowed_sitecustomize"] = _mod
    _spec.loader.exec_module(_mod)
