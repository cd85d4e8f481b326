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
from pathlib import Path

from ..harness.repo import REPO

PACKAGES = {"ckptless": "ckptless", "launcher": "ckptless.launcher", "chaos": "ckptless.chaos"}
MAX_LINES = 500

#: The layers, lowest first: a module may import its own layer and the ones below, never above.
LAYERS: list[tuple[str, ...]] = [
    ("ckptless.errors", "ckptless.environment"),
    ("ckptless.state", "ckptless.mirror", "ckptless.coordinator", "ckptless.snapshot", "ckptless.goodput",
     "ckptless.recovery", "ckptless.sampler", "ckptless.sample_seeds", "ckptless.data", "ckptless.passes", "ckptless.metrics", "ckptless.chaos_hooks", "ckptless.report",
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


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_pkg else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
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
