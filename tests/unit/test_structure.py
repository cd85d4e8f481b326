"""The code's shape, checked: one-way dependencies, modules of one size, one configuration boundary.

Why a test: issue 18 found an import cycle (``job.py`` <-> ``worker/``), library
modules reaching back up into the user API, files of 600+ lines holding
several concepts, and the environment read in seventeen files. Each was fixed
once; these checks keep them fixed. They read the source (``ast``), import
nothing, and count every import: at module level, inside functions, and under
``TYPE_CHECKING`` (a type-only import is still an arrow a reader follows).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

from ..harness.repo import REPO

PACKAGES = {"ckptless": "ckptless", "launcher": "ckptless.launcher", "chaos": "ckptless.chaos"}
MAX_LINES = 500

#: The layers, lowest first: a module may import its own layer and the ones below, never above.
LAYERS: list[tuple[str, ...]] = [
    ("ckptless.errors", "ckptless.environment", "ckptless.lazy"),
    ("ckptless.state", "ckptless.mirror", "ckptless.coordinator", "ckptless.snapshot", "ckptless.goodput",
     "ckptless.recovery", "ckptless.sampler", "ckptless.sample_seeds", "ckptless.data", "ckptless.passes", "ckptless.metrics", "ckptless.chaos_hooks", "ckptless.report", "ckptless.simulate",
     "ckptless.carried", "ckptless.loop_check"),
    ("ckptless.worker",),
    ("ckptless.job", "ckptless.loop", "ckptless.cli"),
    ("ckptless.integrations",),
    ("ckptless.launcher",),
    ("ckptless.chaos",),
    ("ckptless",),  # the package itself: re-exports the user API lazily
]

#: Modules that may touch ``os.environ``: the configuration boundary, and the watcher of a user
#: script's own rank reads (it observes the script's reads, it reads no configuration).
ENVIRON_ALLOWED = {"ckptless/environment.py", "ckptless/worker/rank_reads.py"}


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for folder, dotted in PACKAGES.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([dotted, *parts])] = path
    return out


def _import_statements(name: str, path: Path, runtime_only: bool = False) -> Iterator[tuple[str, str | None]]:
    """Each ``import m`` of module ``name`` (at ``path``) as ``(m, None)`` and each ``from base import a`` as
    ``(base, a)``, relative bases resolved; ``runtime_only``: imports under ``TYPE_CHECKING`` left out."""
    tree = ast.parse(path.read_text())
    typing_only = {id(n) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for n in ast.walk(node)} if runtime_only else set()
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, None
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                yield base, alias.name


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports (``from pkg import mod`` counts as ``pkg.mod``; a name a package's
    ``__init__`` re-exports counts as the module that defines it: the arrow a reader follows)."""
    found: set[str] = set()
    for base, alias in _import_statements(name, path):
        sub = f"{base}.{alias}"
        found.add(base if alias is None else sub if sub in modules else _defined_in(base, alias, modules))
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(module: str) -> int:
    best, best_len = len(LAYERS), -1
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best_len:
                best, best_len = i, len(p)
    return best


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_graph_is_read() -> None:
    graph = _graph()
    assert len(graph) > 100 and sum(map(len, graph.values())) > 200, "too few modules or imports: the test is broken"
    assert "ckptless.worker.driver" in graph["ckptless.job"]


def test_no_import_cycle() -> None:
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_one() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_dependencies_point_down() -> None:
    """No arrow from a lower layer up: nothing under ckptless.worker (or below) imports ckptless.job."""
    up = defaultdict(list)
    for src, targets in _graph().items():
        for dst in targets:
            if _layer(dst) > _layer(src):
                up[src].append(dst)
    assert not up, f"imports pointing up a layer: {dict(up)}"


def test_modules_stay_small() -> None:
    big = {str(p.relative_to(REPO)): n for p in _modules().values()
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (split them by concept): {big}"


_ENV_NAMES = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}


def _environ_uses(path: Path) -> list[int]:
    """Lines where code (not a string: chaos/script.py writes a sitecustomize for the user's
    workers as text) reaches the process environment through ``os``, under any alias."""
    tree = ast.parse(path.read_text())
    aliases = {"os"}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name == "os"}
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            lines += [node.lineno for a in node.names if a.name in _ENV_NAMES]
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in _ENV_NAMES and isinstance(node.value, ast.Name)
                and node.value.id in aliases):
            lines.append(node.lineno)
    return sorted(lines)


def test_environment_is_read_in_one_place() -> None:
    found = [f"{path.relative_to(REPO)}:{n}" for path in _modules().values()
             if str(path.relative_to(REPO)) not in ENVIRON_ALLOWED for n in _environ_uses(path)]
    assert not found, f"environment touched outside ckptless/environment.py: {found}"


def test_environ_finder_sees_aliases(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("import os as o\nfrom os import getenv\nx = o.environ.get('A')\ns = 'os.environ'\n")
    assert _environ_uses(f) == [2, 3]


#: Module-level state in ckptless/worker/, each justified (issue 40: the driver owns the run's state; what is
#: left here is process-global by nature: one process has one set of file descriptors, one CUDA context,
#: one os.environ, one atexit/excepthook chain, torch's process-wide group registry and c10d hooks, and
#: threads that outlive a generation's objects). ``path name`` -> why it cannot be an object someone passes.
_ABORT = "the one abort service of the process: NCCL communicators are process-global and any thread (the control "
_ABORT += "thread, a broken collective's callback) may ask for a generation's abort"
_GUARD = "the process's exit: atexit and sys.excepthook hooks exist once per process"
_FORM = "backends torch builds for a generation, found by the abort service and torch's backend hook (process-wide)"
_GROUPS = "torch's process groups are process-global and held by user code across generations"
_READS = "the watch of the script's own rank reads patches os.environ and get_rank: once per process"
_REAPER = "teardown threads of released groups outlive the generation that started them: bounded per process"
_SOCKETS = "file descriptors are process-global; the at-fork hook is registered once per process"
_CONST = "a constant: never written"
WORKER_GLOBALS = {
    **{f"ckptless/worker/abort.py {n}": _ABORT for n in ("_requests", "_lock", "_thread", "_aborted", "_queued")},
    "ckptless/worker/device.py _bound": "the device and CUDA backend this process is bound to: one per process",
    **{f"ckptless/worker/exit_guard.py {n}": _GUARD for n in ("_installed", "_exit_code", "_pending", "_joins",
                                                               "_uncaught")},
    **{f"ckptless/worker/forming.py {n}": _FORM for n in ("_by_generation", "_aborted", "_aborted_generations",
                                                          "_lock")},
    "ckptless/worker/generation.py _RETIRED_ENGINES": "retired mirror engines whose thread may still run Gloo "
                                                      "operations: freed only once it ended, which may be after "
                                                      "the runtime that retired them is gone",
    "ckptless/worker/gloo_peers.py _warned": "said once per process",
    **{f"ckptless/worker/gloo_peers.py {n}": "Gloo holds only the C++ half of a Python store: the wrappers are kept "
                                             "alive for the process, by generation" for n in ("_alive", "_alive_lock")},
    **{f"ckptless/worker/groups.py {n}": _GROUPS for n in ("_registry", "_live", "_lock", "_early_mirror",
                                                           "_pinned_mirrors")},
    **{f"ckptless/worker/rank_reads.py {n}": _READS for n in ("_lock", "_reads", "_active", "_from_start",
                                                              "_get_rank_watched", "_saved", "_copying")},
    **{f"ckptless/worker/rank_reads.py {n}": "when the process's setup began and which modules it had loaded: "
                                           "recorded from the process's first line, before any runtime exists"
       for n in ("_times", "_modules")},
    **{f"ckptless/worker/reaper.py {n}": _REAPER for n in ("_lock", "_running", "_finished", "_kept")},
    "ckptless/worker/rebindable.py _broken_listeners": "called from torch's done-callbacks on any thread, for groups "
                                                       "that are process-global (see groups.py)",
    "ckptless/worker/rebindable.py _lazy_lock": "serialises a change of the process environment (TORCH_GLOO_LAZY_INIT)",
    **{f"ckptless/worker/sockets.py {n}": _SOCKETS for n in ("_lock", "_shutdown_lock", "_by_generation",
                                                             "_listener_ports", "_peer_listeners", "_fork_hook")},
    **{f"ckptless/worker/{p}": _CONST for p in ("faults.py DEVICE_ERROR_CODES", "nccl_env.py _REFUSED",
                                                "gloo_peers.py _U64", "training.py NO_MORE_STEPS",
                                                "spare_site/__init__.py DIR", "spare_site/sitecustomize.py _HERE")},
}
_IMMUTABLE_CALLS = {"logging.getLogger", "TypeVar", "frozenset", "tuple", "re.compile", "NewType", "timedelta",
                    "lazy.exports"}  # (a package facade's __getattr__: a function over a constant table)


def _module_state(path: Path) -> list[tuple[int, str]]:
    """Module-level names bound to something mutable (a container, an object a call made), or rebound by
    ``global``: state shared by everything in the process that imports the module."""
    tree = ast.parse(path.read_text())
    rebound = {n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names}
    out = []
    for node in tree.body:
        target, value = None, None
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target, value = node.targets[0].id, node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            target, value = node.target.id, node.value
        if target is None or target == "__all__":
            continue
        mutable = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
            isinstance(value, ast.Call) and ast.unparse(value.func) not in _IMMUTABLE_CALLS)
        if mutable or target in rebound:
            out.append((node.lineno, target))
    return out


def test_module_state_in_worker_is_justified() -> None:
    found = {f"{path.relative_to(REPO)} {name}": n for path in sorted((REPO / "ckptless" / "worker").rglob("*.py"))
             for n, name in _module_state(path)}
    unjustified = sorted(k for k in found if k not in WORKER_GLOBALS)
    stale = sorted(k for k in WORKER_GLOBALS if k not in found)
    assert not unjustified, f"module-level state in ckptless/worker/ (an object the driver owns, or justify it): {unjustified}"
    assert not stale, f"justified but gone (remove from WORKER_GLOBALS): {stale}"



#: Every package's ``__init__`` is its whole surface: code outside a package imports from the package, never from
#: a module inside it (issue 40: 18 of state/'s 21 modules were imported directly, so its surface was every file).
#: ``package`` -> why it may not have one (one line each; none today: the packages' dependencies form no cycle,
#: and ckptless/lazy.py's facades import nothing until a name is used, so no import grows).
FACADE_EXEMPT: dict[str, str] = {}


def _facades() -> list[str]:
    return sorted(name for name, path in _modules().items()
                  if path.name == "__init__.py" and "." in name and name not in FACADE_EXEMPT)


def _module_imports_bypassing(facade: str) -> list[str]:
    """``path:line module`` of each import, outside ``facade``, of one of its modules (``from facade.mod import``,
    ``import facade.mod``)."""
    out = []
    for name, path in _modules().items():
        if name == facade or name.startswith(facade + "."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = ([node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                       else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            out += [f"{path.relative_to(REPO)}:{node.lineno} {t}" for t in targets if t.startswith(facade + ".")]
    return out


def test_packages_are_imported_through_their_init() -> None:
    facades = _facades()
    assert {"ckptless.state", "ckptless.worker", "ckptless.worker.spare_site"} <= {*facades, *FACADE_EXEMPT}, "broken"
    found = {facade: bad for facade in facades if (bad := _module_imports_bypassing(facade))}
    assert not found, f"imports that bypass a package's __init__ (add the name to its __all__): {found}"


def _declared(init: Path) -> set[str]:
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return {e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return set()


def test_what_a_facade_exports_it_names_in_all() -> None:
    """Every name imported from a facade package is in its ``__all__`` (its surface is written down in one place)."""
    modules = _modules()
    for facade in _facades():
        declared = _declared(modules[facade])
        used = {a.name for name, path in modules.items() if not name.startswith(facade + ".")
                for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, ast.ImportFrom) and node.module == facade for a in node.names}
        assert used <= declared, f"{facade}: imported but not in __all__: {sorted(used - declared)}"


def _lazy_table(init: Path) -> dict[str, str] | None:
    """The ``{module: "names"}`` a facade passes to ``lazy.exports``, as ``name -> module`` (None: not lazy)."""
    for node in ast.walk(ast.parse(init.read_text())):
        if isinstance(node, ast.Call) and ast.unparse(node.func).endswith("exports") and len(node.args) == 2:
            table = ast.literal_eval(node.args[1])
            return {n: m for m, names in table.items() for n in names.split()}
    return None


def test_a_lazy_facade_imports_what_it_names() -> None:
    """A lazy facade (ckptless/lazy.py) names each lazy export twice: its runtime table, and the imports under
    ``TYPE_CHECKING`` that type checkers and readers follow. Both say the same; ``__all__`` holds the table's names,
    and any other name in it is a submodule (``from package import module``) or imported eagerly."""
    modules = _modules()
    lazy = 0
    for facade in _facades():
        init = modules[facade]
        table = _lazy_table(init)
        if table is None:
            continue
        lazy += 1
        typed = {(a.asname or a.name): (node.module or "").removeprefix(facade + ".")
                 for block in ast.walk(ast.parse(init.read_text()))
                 if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                 for node in ast.walk(block)
                 if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(facade + ".")
                 for a in node.names}
        assert typed == table, f"{facade}: TYPE_CHECKING imports and lazy table differ: {set(typed.items()) ^ set(table.items())}"
        eager = {a.asname or a.name for node in ast.parse(init.read_text()).body if isinstance(node, ast.ImportFrom)
                 for a in node.names}
        rest = {m for m in _declared(init) - set(table) - eager if f"{facade}.{m}" not in modules}
        assert not rest, f"{facade}: __all__ names no such export: {sorted(rest)}"
        assert set(table) <= _declared(init), f"{facade}: exported but not in __all__: {sorted(set(table) - _declared(init))}"
    assert lazy >= 1, "the lazy-table finder is broken"


def _protocol_methods() -> dict[str, str]:
    """Method names declared by the project's runtime-checkable ``typing.Protocol`` classes (those meant for
    ``isinstance``; a user-facing duck type such as ``Stateful`` is not one) -> the protocol's name."""
    out = {}
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.ClassDef) and any(ast.unparse(b).endswith("Protocol") for b in node.bases)
                    and any(ast.unparse(d).endswith("runtime_checkable") for d in node.decorator_list)):
                out |= {f.name: node.name for f in node.body if isinstance(f, ast.FunctionDef)
                        and not f.name.startswith("__")}
    return out


#: Lookups by a protocol method's name that are duck typing on the user's objects, not a hidden arrow between
#: project modules: ``path name`` -> why.
DUCK_TYPED = {
    "ckptless/state/dtensor.py state_dict": "scans any protected object that can report a state (a user's own "
                                            "Stateful-like object) for a device mesh; no project class behind it",
}


def test_protocols_are_not_found_by_name() -> None:
    """A dependency declared as a Protocol is used through it (``isinstance``, a typed parameter), never found on
    an object by ``getattr``/``hasattr`` with its method's name: that is an arrow no import shows (issue 40:
    state/ddp.py found the worker group's ``answers_locally`` so)."""
    methods = _protocol_methods()
    assert "answers_locally" in methods, "the protocol finder is broken"
    found = []
    for path in _modules().values():
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                    and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in methods):
                if f"{path.relative_to(REPO)} {node.args[1].value}" not in DUCK_TYPED:
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.args[1].value}")
    assert not found, f"protocol methods looked up by name: {found}"


#: The pure machines: neither they nor the code they use (the modules they import, transitively; a name a
#: package re-exports counts as the module defining it; a type-only import under ``TYPE_CHECKING`` runs
#: nothing) read the clock, a file, the environment, a socket or a process, or log: every fact reaches them
#: as an event, every effect leaves as an action (issue 40).
PURE_MACHINES = ("ckptless.launcher.node_machine", "ckptless.worker.machine", "ckptless.recovery.leader_machine")
IO_MODULES = {"os", "sys", "time", "socket", "subprocess", "signal", "shutil", "tempfile", "select", "selectors",
              "asyncio", "pathlib", "io", "logging", "urllib", "http", "multiprocessing", "ctypes", "mmap",
              "datetime", "random", "grpc", "etcd3"}


def _runtime_imports(path: Path, modules: dict[str, Path], name: str) -> set[str]:
    """Every module ``path`` imports when it runs (project or not), imports under TYPE_CHECKING left out."""
    found: set[str] = set()
    for base, alias in _import_statements(name, path, runtime_only=True):
        sub = f"{base}.{alias}"
        # A name a package re-exports counts as the module that defines it: that is the code used.
        found.add(base if alias is None else sub if sub in modules else _defined_in(base, alias, modules))
    return found


def _defined_in(package: str, name: str, modules: dict[str, Path]) -> str:
    """The module of ``package`` that ``name`` comes from, by its ``__init__``'s imports (else the package)."""
    path = modules.get(package)
    if path is None or path.name != "__init__.py":
        return package
    for node in ast.walk(ast.parse(path.read_text())):  # (a lazy facade's imports are under TYPE_CHECKING)
        if isinstance(node, ast.ImportFrom) and node.module and any((a.asname or a.name) == name for a in node.names):
            return node.module if node.module in modules else package
    return package


def _io_reached(root: str) -> dict[str, set[str]]:
    modules = _modules()
    seen: set[str] = set()
    todo, io = [root], {}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        found = _runtime_imports(modules[name], modules, name)
        bad = {m for m in found if m.split(".")[0] in IO_MODULES}
        if bad:
            io[name] = bad
        todo += [m for m in found if m in modules]
    return io


def test_the_machines_import_no_io() -> None:
    found = {root: io for root in PURE_MACHINES if (io := _io_reached(root))}
    assert not found, f"a pure machine reaches I/O through its imports: {found}"


def test_the_io_finder_finds_one(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("import json\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import os\n"
                 "def f():\n    import time\n")
    assert _runtime_imports(f, {}, "m") == {"json", "typing", "time"}


#: Who may act on the agent's workers (issue 40: no kill, respawn or refill decided outside the node machine).
#: ``call name`` -> the launcher modules allowed to make it, and why there.
WORKER_ACTIONS = {
    "send_signal": {"launcher/node_driver.py": "the machine's Kill", "launcher/workers.py": "the group itself"},
    "respawn": {"launcher/respawn.py": "the machine's StartRespawn and Reexec, run by the driver"},
    "add_like": {"launcher/refill.py": "the machine's StartSpare, run by the driver"},
    "signal_all": {"launcher/agent.py": "the signal handler forwards the signal it caught, at once (torchrun "
                                        "does too); the machine decides the exit code from it",
                   "launcher/workers.py": "the group itself"},
}
EXECUTORS = {"respawn.start", "respawn.reexec", "refill.start_spare"}


def test_only_the_node_machines_driver_acts_on_workers() -> None:
    found = []
    for path in (REPO / "launcher").glob("*.py"):
        rel = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            call = ast.unparse(node.func)
            if node.func.attr in WORKER_ACTIONS and rel not in WORKER_ACTIONS[node.func.attr]:
                found.append(f"{rel}:{node.lineno} {call}")
        for node in ast.walk(ast.parse(path.read_text())):  # passed as a thread's target counts too
            if isinstance(node, ast.Attribute) and ast.unparse(node) in EXECUTORS and rel != "launcher/node_driver.py":
                found.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    assert not found, f"workers acted on outside the node machine's driver: {sorted(set(found))}"


#: WorkerRuntime's fields are written by its driver (worker/driver.py) and its own methods, nowhere else (issue
#: 40): an executor returns what it changed (``worker/runtime.py``'s ``Changed``) and the driver applies it.


def _runtime_fields() -> set[str]:
    tree = ast.parse((REPO / "ckptless" / "worker" / "runtime.py").read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "WorkerRuntime")
    return {t.attr for n in ast.walk(cls) if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Attribute) and ast.unparse(t.value) == "self"}


def test_worker_runtime_is_written_by_its_driver() -> None:
    """A write is an assignment to ``<rt|runtime|self.rt|job._rt...>.<field>`` of a WorkerRuntime field."""
    fields = _runtime_fields()
    assert {"gen", "own_images", "spec"} <= fields, "the field finder is broken"
    found = set()
    for path in _modules().values():
        rel = str(path.relative_to(REPO))
        if rel in ("ckptless/worker/runtime.py", "ckptless/worker/driver.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                for x in ast.walk(t):
                    if (isinstance(x, ast.Attribute) and x.attr in fields
                            and ast.unparse(x.value).split(".")[-1] in ("rt", "_rt", "runtime", "_runtime")):
                        found.add(f"{rel} {x.attr}")
    assert not found, f"WorkerRuntime written outside its driver (return it in a Changed): {sorted(found)}"
