"""Registers the tests' NCCL-semantics backend in every Python process of a test job that selects it.

A test puts this directory first on the job's ``PYTHONPATH`` together with
``CKPTLESS_CPU_BACKEND=nccl_like``: the worker scripts (the examples among
them) then run unchanged, their groups on ``tests/harness/nccl_like.py``.
"""

import importlib
import os

if os.environ.get("CKPTLESS_CPU_BACKEND") == "nccl_like":
    importlib.import_module("tests.harness.nccl_like")  # registers the backend before the script's init()
