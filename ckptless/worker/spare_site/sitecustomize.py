"""Python imports this at start-up, before the script, in every worker of a node with spares
(``ckptless-run`` puts its directory first on their ``PYTHONPATH``; see ``__init__.py`` beside it).

It leaves ``sys.path`` as the script would have had it (this directory removed), runs the
``sitecustomize`` it shadows (the site's own, a test's, the chaos runner's), and then, in a spare
only, starts watching the script's rank reads (:func:`ckptless.worker.rank_reads.at_process_start`):
reads made by the shadowed ``sitecustomize`` are not the script's. Imports no torch.
"""

import importlib.machinery
import importlib.util
import os.path
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _run_shadowed() -> None:
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if spec is not None and spec.loader is not None and spec.origin is not None \
            and os.path.realpath(spec.origin) != os.path.realpath(__file__):
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module  # as if Python had imported it itself
        spec.loader.exec_module(module)


sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
try:
    _run_shadowed()
finally:  # its errors are printed by site as before; the watch starts either way
    try:
        from ckptless.worker import rank_reads
    except ImportError:  # no ckptless here (a tool the script runs): nothing to watch for
        pass
    else:
        rank_reads.at_process_start()
