"""Which locals a step loop carries from one iteration to the next: the start-up check behind ``job.carry``.

Why: a value the loop body reads before it assigns it (``model(X, Y)`` then
``X, Y = get_batch()``; ``if val < best: best = val``; ``n += 1``) comes from
the iteration before. After a recovery the loop resumes with the resume
version's model, optimizer and RNG, but such a local still holds what this
process last left in it (a survivor: a later step's; a replacement: its
setup's), and the run quietly trains on other data. Nothing at run time can
tell a stale batch from a fresh one without keeping a copy of it; the source
can: ``job.steps`` reads its caller's loop once, at its first step, and rank
0 names the carried locals that no ``job.carry`` protects (one warning line,
which the chaos verdict quotes beside a FAIL).

The analysis (pure: source text and a line in, names out) is a
definite-assignment walk over the loop body: a ``Name`` read at a point where
the body has not certainly assigned it yet in this iteration, and that the
body assigns somewhere, is carried. Branches meet by intersection (a branch
that ends in ``continue``/``break``/``return``/``raise`` does not count);
an inner loop's body is taken to run at least once (a loop over
micro-steps does; the alternative names every local such a loop assigns); a nested function's body is not
entered (when it runs is unknown). Attributes and subscripts
(``self.best = ...``, ``state["n"] += 1``) are objects, not locals: not seen.
It is a reading of the source, not a proof: a local that may differ harmlessly
(a wall-clock ``t0``) is silenced with ``job.carry(ignore=("t0",))``; what it
misses, the chaos verdict's digests still catch.
"""

from __future__ import annotations

import ast
import linecache
import logging
import os
from dataclasses import dataclass
from typing import Any

__all__ = ["HINT", "LoopFinding", "carried_names", "find_loop", "warn_unprotected"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopFinding:
    line: int                   # the loop statement's first line
    carried: dict[str, int]     # name -> line of its first read before an assignment, in body order


def find_loop(tree: ast.AST, line: int) -> ast.For | ast.AsyncFor | ast.While | None:
    """The innermost loop whose header (``for ... in <iter>:``) spans ``line``."""
    best: ast.For | ast.AsyncFor | ast.While | None = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.AsyncFor)):
            head_end = node.iter.end_lineno or node.lineno
        elif isinstance(node, ast.While):
            head_end = node.test.end_lineno or node.lineno
        else:
            continue
        if node.lineno <= line <= head_end and (best is None or node.lineno >= best.lineno):
            best = node
    return best


def carried_names(source: str, line: int) -> LoopFinding | None:
    """The locals the loop at ``line`` of ``source`` carries across iterations (None: no loop there)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    loop = find_loop(tree, line)
    if loop is None:
        return None
    walk = _Walk()
    start: set[str] = set()
    if isinstance(loop, (ast.For, ast.AsyncFor)):
        start = _targets(loop.target)  # the loop assigns its target first, each iteration
    walk.block(loop.body, frozenset(start))
    carried = {n: ln for n, ln in walk.exposed.items() if n in walk.stored and n not in start}
    return LoopFinding(loop.lineno, dict(sorted(carried.items(), key=lambda kv: (kv[1], kv[0]))))


def _targets(node: ast.AST) -> set[str]:
    """Names an assignment target binds (``a``, ``a, (b, *c)``; not ``a.x`` or ``a[i]``)."""
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, (ast.Tuple, ast.List)):
        return set().union(*(_targets(e) for e in node.elts)) if node.elts else set()
    if isinstance(node, ast.Starred):
        return _targets(node.value)
    return set()


_ENDS = (ast.Continue, ast.Break, ast.Return, ast.Raise)
Defined = frozenset[str] | None  # None: this path left the iteration (it constrains nothing after it)


def _meet(a: Defined, b: Defined) -> Defined:
    if a is None:
        return b
    if b is None:
        return a
    return a & b


class _Walk:
    """Definite assignment over one loop body: ``exposed`` reads, ``stored`` names."""

    def __init__(self) -> None:
        self.exposed: dict[str, int] = {}
        self.stored: set[str] = set()

    # --- expressions: every Name load checked against what is defined here ---------------------------
    def expr(self, node: ast.AST | None, defined: frozenset[str]) -> frozenset[str]:
        """Reads in ``node`` (evaluation order near enough); returns ``defined`` plus walrus targets."""
        if node is None:
            return defined
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load) and node.id not in defined:
                self.exposed.setdefault(node.id, node.lineno)
            return defined
        if isinstance(node, ast.NamedExpr):
            defined = self.expr(node.value, defined)
            self.stored.add(node.target.id)
            return defined | {node.target.id}
        if isinstance(node, ast.Lambda):
            for d in (*node.args.defaults, *[k for k in node.args.kw_defaults if k is not None]):
                defined = self.expr(d, defined)
            return defined  # its body runs when called: unknown
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            return self._comprehension(node, defined)
        for child in ast.iter_child_nodes(node):
            defined = self.expr(child, defined)
        return defined

    def _comprehension(self, node: ast.ListComp | ast.SetComp | ast.GeneratorExp | ast.DictComp,
                       defined: frozenset[str]) -> frozenset[str]:
        inner = defined
        for gen in node.generators:
            inner = self.expr(gen.iter, inner)
            inner = inner | _targets(gen.target)  # the comprehension's own scope
            for cond in gen.ifs:
                inner = self.expr(cond, inner)
        parts = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
        for part in parts:
            self.expr(part, inner)
        return defined

    def _store(self, target: ast.AST, defined: frozenset[str]) -> frozenset[str]:
        """An assignment target: names bound; an attribute's or subscript's object and index are reads."""
        if isinstance(target, ast.Name):
            self.stored.add(target.id)
            return defined | {target.id}
        if isinstance(target, (ast.Tuple, ast.List)):
            for e in target.elts:
                defined = self._store(e, defined)
            return defined
        if isinstance(target, ast.Starred):
            return self._store(target.value, defined)
        self.expr(target, defined)  # a.x = ..., a[i] = ...: reads a (and i)
        return defined

    # --- statements ------------------------------------------------------------------------------------
    def block(self, body: list[ast.stmt], defined: Defined) -> Defined:
        for stmt in body:
            if defined is None:
                return None  # unreachable in this iteration
            defined = self.stmt(stmt, defined)
        return defined

    def stmt(self, s: ast.stmt, d: frozenset[str]) -> Defined:
        if isinstance(s, ast.Assign):
            d = self.expr(s.value, d)
            for t in s.targets:
                d = self._store(t, d)
            return d
        if isinstance(s, ast.AnnAssign):
            if s.value is None:
                return d
            return self._store(s.target, self.expr(s.value, d))
        if isinstance(s, ast.AugAssign):
            d = self.expr(s.value, d)
            if isinstance(s.target, ast.Name):
                self.expr(ast.copy_location(ast.Name(s.target.id, ast.Load()), s.target), d)  # n += 1 reads n
            return self._store(s.target, d)
        if isinstance(s, ast.If):
            d = self.expr(s.test, d)
            return _meet(self.block(s.body, d), self.block(s.orelse, d))
        if isinstance(s, (ast.For, ast.AsyncFor)):
            d = self.expr(s.iter, d)
            after = self.block(s.body, self._store(s.target, d))
            self.block(s.orelse, d)
            return after if after is not None else d  # taken to run once at least (micro-steps do)
        if isinstance(s, ast.While):
            d = self.expr(s.test, d)
            after = self.block(s.body, d)
            self.block(s.orelse, d)
            return after if after is not None else d
        if isinstance(s, (ast.With, ast.AsyncWith)):
            for item in s.items:
                d = self.expr(item.context_expr, d)
                if item.optional_vars is not None:
                    d = self._store(item.optional_vars, d)
            return self.block(s.body, d)
        if isinstance(s, ast.Try) or type(s).__name__ == "TryStar":
            return self._try(s, d)
        if isinstance(s, ast.Match):
            d = self.expr(s.subject, d)
            out: Defined = d  # no case may match (errs towards naming)
            for case in s.cases:
                names = {n.name for n in ast.walk(case.pattern) if isinstance(n, (ast.MatchAs, ast.MatchStar))
                         and n.name} | {n.rest for n in ast.walk(case.pattern)
                                        if isinstance(n, ast.MatchMapping) and n.rest}
                self.stored |= names
                out = _meet(out, self.block(case.body, self.expr(case.guard, d | names)))
            return out
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for dec in s.decorator_list:
                d = self.expr(dec, d)
            if not isinstance(s, ast.ClassDef):
                for default in (*s.args.defaults, *[k for k in s.args.kw_defaults if k is not None]):
                    d = self.expr(default, d)
            self.stored.add(s.name)
            return d | {s.name}
        if isinstance(s, (ast.Import, ast.ImportFrom)):
            names = {(a.asname or a.name).split(".")[0] for a in s.names if a.name != "*"}
            self.stored |= names
            return d | names
        if isinstance(s, ast.Delete):
            for t in s.targets:  # `del x` needs x bound: a read
                self.expr(ast.copy_location(ast.Name(t.id, ast.Load()), t) if isinstance(t, ast.Name) else t, d)
            return d - {t.id for t in s.targets if isinstance(t, ast.Name)}
        if isinstance(s, _ENDS):
            for child in ast.iter_child_nodes(s):
                self.expr(child, d)
            return None
        for child in ast.iter_child_nodes(s):  # Expr, Assert, Global, Nonlocal, Pass, ...
            d = self.expr(child, d)
        return d

    def _try(self, s: ast.stmt, d: frozenset[str]) -> Defined:
        body = self.block(s.body, d)  # type: ignore[attr-defined]
        out = self.block(s.orelse, body) if body is not None else None  # type: ignore[attr-defined]
        for h in s.handlers:  # type: ignore[attr-defined]
            hd = self.expr(h.type, d)  # a handler may run after any part of the body: from d
            if h.name:
                self.stored.add(h.name)
                hd = hd | {h.name}
            out = _meet(out, self.block(h.body, hd))
        if s.finalbody:  # type: ignore[attr-defined]
            fin = self.block(s.finalbody, d)  # type: ignore[attr-defined]
            if fin is None:
                return None
            return out | fin if out is not None else None
        return out


# --- the check at a loop's first step (reads the caller's source; the only impure part) ---------------

HINT = "carries unprotected from one iteration to the next"
"""The warning's fixed words (the chaos verdict quotes the line that holds them beside a FAIL)."""

_SEEN: set[tuple[str, int]] = set()
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep  # this package's own files


def warn_unprotected(frame: Any, carried: Any = None) -> LoopFinding | None:
    """At a ``job.steps`` loop's first step: warn once per loop when it carries locals nothing protects.

    ``frame``: the loop's frame; ``carried``: the job's :class:`~ckptless.carried.Carried` (its ``ignore``
    names are not warned about). Never raises: a source that cannot be read (an interactive session,
    a frozen module) or parsed means no check. Cost: one parse of the file, once per loop.
    """
    try:
        code = frame.f_code
        where = (code.co_filename, frame.f_lineno)
        if where in _SEEN or os.path.abspath(code.co_filename).startswith(_PACKAGE):
            return None  # checked already, or a loop of ckptless's own (an integration's)
        _SEEN.add(where)
        source = "".join(linecache.getlines(code.co_filename))
        found = carried_names(source, frame.f_lineno) if source else None
    except Exception:  # noqa: BLE001 - a check that cannot run must not stop the job
        log.debug("loop-carried check skipped", exc_info=True)
        return None
    if found is None:
        return None
    ignored = carried._ignored if carried is not None else frozenset()  # noqa: SLF001 - its own namespace
    names = [n for n in found.carried if n not in ignored]
    if not names:
        return found
    declared = [n for n in names if carried is not None and n in carried._values]  # noqa: SLF001
    also = (f"; {', '.join(declared)} {'is' if len(declared) == 1 else 'are'} declared in job.carry but the loop "
            f"reads the local: use the namespace's attribute" if declared else "")
    log.warning("ckptless: the loop at %s:%d %s: %s (first read at line %s, before the body assigns it)%s. After a "
                "recovery they hold this process's last values, not the resume step's (a prefetched batch of "
                "another step, a best metric reset), and the run is no longer the fault-free one: keep them in "
                "c = job.carry(%s) and use c.<name> (docs/porting.md, \"Loop-carried values\"), or list those that "
                "may differ in job.carry(ignore=...)",
                os.path.basename(where[0]), found.line, HINT, ", ".join(names),
                ", ".join(str(found.carried[n]) for n in names), also, ", ".join(f"{n}=..." for n in names))
    return found
