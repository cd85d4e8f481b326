"""A package's surface, named in its ``__init__`` and imported on first use (PEP 562).

Why: code outside a package imports it through the package's ``__init__``
(issue 40; ``tests/unit/test_structure.py``), so that the ``__init__`` is the
package's whole API. But Python runs a package's ``__init__`` before any
module of it: an ``__init__`` that imported its modules would make every user
of one module import them all. That would make ``ckptless-run``'s start import
torch (it needs ``ckptless.worker.exit_guard``), the pure machines import
their packages' I/O (``recovery/leader_machine.py`` beside the etcd leader),
and a spare's ``sitecustomize`` load the modules whose import it measures.
A facade made here imports a name's module when the name is first looked up,
exactly what importing that module directly did: no import time, no new
import cycle. The ``__init__`` also imports the same names under
``TYPE_CHECKING``, for type checkers and readers; the structure test keeps
the two lists equal.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def exports(package: str, where: dict[str, str]) -> Callable[[str], Any]:
    """The ``__getattr__`` of ``package``: ``where`` maps each of its modules (relative name) to the names it
    exports, space-separated. A submodule not named here (``from package import module``) is imported by Python
    itself once this raises ``AttributeError``."""
    origin = {name: f"{package}.{module}" for module, names in where.items() for name in names.split()}

    def __getattr__(name: str) -> Any:
        module = origin.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)  # once: later lookups find it in the package's namespace
        return value

    return __getattr__
