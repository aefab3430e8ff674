"""Bug injection: single-site, AST-level mutations of one function, SWE-smith style.

Each mutator finds the places in a module where it applies (a :class:`Mutation` per site, always inside
one function) and rewrites only the text of that site, so the rest of the file keeps its formatting and
comments: a reformatted function would point at the bug. Every rewrite is checked by parsing the result
and comparing its AST with the original AST changed at exactly that node; a site whose text edit does not
produce exactly that change is dropped.

The kinds follow SWE-smith's procedural modifiers (``swesmith.bug_gen.procedural``): flip a comparison,
off-by-one at a boundary, swap the operands of a non-commutative operator, change an operator, drop a
branch, change an integer constant. Why raas has its own instead of importing swesmith's is in docs/tasks/swe.md
("SWE-style tasks").
"""

from __future__ import annotations

import ast
import copy
import hashlib
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from dataclasses import field as dataclass_field

# Comparison negations (flip) and boundary shifts (off-by-one).
_NEGATED: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.GtE,
    ast.GtE: ast.Lt,
    ast.Gt: ast.LtE,
    ast.LtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
}
_BOUNDARY: dict[type[ast.cmpop], type[ast.cmpop]] = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
}
_CMP_TEXT: dict[type[ast.cmpop], str] = {
    ast.Lt: "<",
    ast.LtE: "<=",
    ast.Gt: ">",
    ast.GtE: ">=",
    ast.Eq: "==",
    ast.NotEq: "!=",
    ast.Is: "is",
    ast.IsNot: "is not",
    ast.In: "in",
    ast.NotIn: "not in",
}
_CMP_PATTERN: dict[type[ast.cmpop], str] = {
    ast.Lt: r"<(?!=)",
    ast.LtE: r"<=",
    ast.Gt: r">(?!=)",
    ast.GtE: r">=",
    ast.Eq: r"==",
    ast.NotEq: r"!=",
    ast.Is: r"\bis\b(?!\s+not\b)",
    ast.IsNot: r"\bis\s+not\b",
    ast.In: r"(?<!not )\bin\b",
    ast.NotIn: r"\bnot\s+in\b",
}
# Operators whose operands can be swapped with a visible effect, and operator changes.
_NON_COMMUTATIVE: dict[type[ast.operator], str] = {
    ast.Sub: "-",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
    ast.LShift: "<<",
    ast.RShift: ">>",
}
_OP_CHANGE: dict[type[ast.operator], tuple[type[ast.operator], str, str]] = {
    ast.Add: (ast.Sub, "+", "-"),
    ast.Sub: (ast.Add, "-", "+"),
    ast.Mult: (ast.FloorDiv, "*", "//"),
    ast.FloorDiv: (ast.Mult, "//", "*"),
    ast.BitAnd: (ast.BitOr, "&", "|"),
    ast.BitOr: (ast.BitAnd, "|", "&"),
}
_BOOL_CHANGE: dict[type[ast.boolop], tuple[type[ast.boolop], str, str]] = {
    ast.And: (ast.Or, "and", "or"),
    ast.Or: (ast.And, "or", "and"),
}


@dataclass(frozen=True)
class Mutation:
    """One applicable bug: where it is, what it does, and the mutated module text."""

    mutator: str
    file: str  # path relative to the repository root
    function: str  # qualified name, e.g. ``LRUCache.popitem``
    functions: tuple[str, ...]  # the function and the functions around it (no classes), outermost first
    lineno: int
    end_lineno: int  # the site's last line (for an if-statement removal: its condition's line)
    description: str  # e.g. "`<` became `>=`"; for logs and metadata, never for problem statements
    original: str  # the whole module before
    mutated: str  # the whole module after
    _check: _Check | None = dataclass_field(default=None, repr=False, compare=False)

    def verify(self) -> bool:
        """Whether the rewrite is exactly the intended one-node change (computed once)."""
        return self._check is None or self._check(self.original, self.mutated)

    @property
    def key(self) -> str:
        """A stable short id of this mutation (file, site and result)."""
        h = hashlib.sha256(f"{self.file}\0{self.mutator}\0{self.lineno}\0{self.mutated}".encode())
        return h.hexdigest()[:8]


@dataclass
class _Site:
    node: ast.AST
    func: str
    edit: Callable[[ast.AST], object]  # changes the node's twin in a copy of the tree, in place
    text: Callable[[str], str | None]  # the module text with the site rewritten
    description: str
    lineno: int = 0
    end_lineno: int = 0


class _Offsets:
    """(line, col) in UTF-8 bytes, as ast reports them, to string offsets."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.lines = source.splitlines(keepends=True)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def index(self, lineno: int, col_byte: int) -> int:
        line = self.lines[lineno - 1]
        return self.starts[lineno - 1] + len(line.encode("utf-8")[:col_byte].decode("utf-8", "replace"))

    def span(self, node: ast.AST) -> tuple[int, int]:
        return (
            self.index(node.lineno, node.col_offset),  # type: ignore[attr-defined]
            self.index(node.end_lineno, node.end_col_offset),  # type: ignore[attr-defined]
        )


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """Every function with its qualified name (methods as ``Class.method``, nested as ``f.g``)."""

    def walk(node: ast.AST, prefix: str) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                yield name, child
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def function_names(tree: ast.Module, qualname: str) -> tuple[str, ...]:
    """The names of the functions (not classes) along ``qualname``, outermost first."""
    out: list[str] = []
    node: ast.AST = tree
    for part in qualname.split("."):
        for child in ast.iter_child_nodes(node):
            if (
                isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and child.name == part
            ):
                if not isinstance(child, ast.ClassDef):
                    out.append(part)
                node = child
                break
        else:
            # Defined deeper (e.g. inside an ``if``): search the subtree.
            for child in ast.walk(node):
                if (
                    isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                    and child.name == part
                ):
                    if not isinstance(child, ast.ClassDef):
                        out.append(part)
                    node = child
                    break
    return tuple(out)


def _own_nodes(func: ast.FunctionDef | ast.AsyncFunctionDef) -> Iterator[ast.AST]:
    """Nodes of the function body, not of nested functions or classes (those are their own sites),
    and not the docstring."""
    body = func.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    stack: list[ast.AST] = list(reversed(body))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        yield node
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _replace_in_gap(source: str, start: int, end: int, pattern: str, new: str) -> str | None:
    """Replace the one operator token matching ``pattern`` between two operands (only whitespace,
    parentheses, line continuations and the operator itself may be there)."""
    gap = source[start:end]
    if "#" in gap:
        return None
    matches = list(re.finditer(pattern, gap))
    if len(matches) != 1:
        return None
    m = matches[0]
    rest = gap[: m.start()] + gap[m.end() :]
    if rest.strip(" \t\r\n()\\"):
        return None
    return source[: start + m.start()] + new + source[start + m.end() :]


class Mutator:
    """Finds sites of one kind of bug in a module."""

    name: str = ""
    summary: str = ""

    def sites(self, tree: ast.Module, off: _Offsets) -> Iterator[_Site]:
        raise NotImplementedError


class _CompareOpMutator(Mutator):
    table: dict[type[ast.cmpop], type[ast.cmpop]] = {}

    def sites(self, tree: ast.Module, off: _Offsets) -> Iterator[_Site]:
        for func_name, func in _functions(tree):
            for node in _own_nodes(func):
                if not (isinstance(node, ast.Compare) and len(node.ops) == 1):
                    continue
                old = type(node.ops[0])
                if old not in self.table:
                    continue
                new = self.table[old]
                left_end = off.index(node.left.end_lineno, node.left.end_col_offset)  # type: ignore[arg-type]
                right = node.comparators[0]
                right_start = off.index(right.lineno, right.col_offset)

                def edit(n: ast.AST, new: type[ast.cmpop] = new) -> ast.AST:
                    assert isinstance(n, ast.Compare)
                    n.ops = [new()]
                    return n

                def text(
                    src: str,
                    a: int = left_end,
                    b: int = right_start,
                    old: type[ast.cmpop] = old,
                    new: type[ast.cmpop] = new,
                ) -> str | None:
                    return _replace_in_gap(src, a, b, _CMP_PATTERN[old], _CMP_TEXT[new])

                yield _Site(node, func_name, edit, text, f"`{_CMP_TEXT[old]}` became `{_CMP_TEXT[new]}`")


class FlipComparison(_CompareOpMutator):
    """``a < b`` → ``a >= b``, ``==`` → ``!=``, ``is`` → ``is not``, ``in`` → ``not in``."""

    name = "flip_comparison"
    summary = "negate a comparison"
    table = _NEGATED


class OffByOne(_CompareOpMutator):
    """``a < b`` → ``a <= b`` (and the other boundaries): the classic off-by-one."""

    name = "off_by_one"
    summary = "move a comparison's boundary by one"
    table = _BOUNDARY


class SwapOperands(Mutator):
    """``a - b`` → ``b - a`` for non-commutative operators."""

    name = "swap_operands"
    summary = "swap the operands of a non-commutative operator"

    def sites(self, tree: ast.Module, off: _Offsets) -> Iterator[_Site]:
        for func_name, func in _functions(tree):
            for node in _own_nodes(func):
                if not (isinstance(node, ast.BinOp) and type(node.op) in _NON_COMMUTATIVE):
                    continue
                if ast.dump(node.left) == ast.dump(node.right):
                    continue
                ls, le = off.span(node.left)
                rs, re_ = off.span(node.right)

                def edit(n: ast.AST) -> ast.AST:
                    assert isinstance(n, ast.BinOp)
                    n.left, n.right = n.right, n.left
                    return n

                def text(src: str, ls: int = ls, le: int = le, rs: int = rs, re_: int = re_) -> str | None:
                    gap = src[le:rs]
                    if gap.strip(" \t") not in _NON_COMMUTATIVE.values() or "\n" in gap:
                        return None  # parentheses or line breaks around the operands: skip
                    return src[:ls] + src[rs:re_] + gap + src[ls:le] + src[re_:]

                op = _NON_COMMUTATIVE[type(node.op)]
                yield _Site(node, func_name, edit, text, f"the operands of `{op}` were swapped")


class ChangeOperator(Mutator):
    """``+`` ↔ ``-``, ``*`` ↔ ``//``, ``&`` ↔ ``|``, ``and`` ↔ ``or``."""

    name = "change_operator"
    summary = "replace an arithmetic or boolean operator"

    def sites(self, tree: ast.Module, off: _Offsets) -> Iterator[_Site]:
        for func_name, func in _functions(tree):
            for node in _own_nodes(func):
                if isinstance(node, ast.BinOp) and type(node.op) in _OP_CHANGE:
                    new_op, old_s, new_s = _OP_CHANGE[type(node.op)]
                    a = off.index(node.left.end_lineno, node.left.end_col_offset)  # type: ignore[arg-type]
                    b = off.index(node.right.lineno, node.right.col_offset)

                    def edit(n: ast.AST, new_op: type[ast.operator] = new_op) -> ast.AST:
                        assert isinstance(n, ast.BinOp)
                        n.op = new_op()
                        return n

                    def text(src: str, a: int = a, b: int = b, o: str = old_s, s: str = new_s) -> str | None:
                        pattern = re.escape(o) + (r"(?![/=*])" if o in ("*", "/") else "")
                        pattern = (r"(?<![/*])" if o in ("*", "/", "//") else "") + pattern
                        return _replace_in_gap(src, a, b, pattern, s)

                    yield _Site(node, func_name, edit, text, f"`{old_s}` became `{new_s}`")
                elif isinstance(node, ast.BoolOp) and len(node.values) == 2:
                    new_bool, old_s, new_s = _BOOL_CHANGE[type(node.op)]
                    left, right = node.values
                    a = off.index(left.end_lineno, left.end_col_offset)  # type: ignore[arg-type]
                    b = off.index(right.lineno, right.col_offset)

                    def bedit(n: ast.AST, new_bool: type[ast.boolop] = new_bool) -> ast.AST:
                        assert isinstance(n, ast.BoolOp)
                        n.op = new_bool()
                        return n

                    def btext(src: str, a: int = a, b: int = b, o: str = old_s, s: str = new_s) -> str | None:
                        return _replace_in_gap(src, a, b, rf"\b{o}\b", s)

                    yield _Site(node, func_name, bedit, btext, f"`{old_s}` became `{new_s}`")


class WrongConstant(Mutator):
    """An integer literal ``n`` → ``n + 1`` (``n - 1`` for n > 1): a wrong constant."""

    name = "wrong_constant"
    summary = "change an integer constant by one"

    def sites(self, tree: ast.Module, off: _Offsets) -> Iterator[_Site]:
        for func_name, func in _functions(tree):
            for node in _own_nodes(func):
                if not (isinstance(node, ast.Constant) and type(node.value) is int):
                    continue
                value = node.value
                new_value = value - 1 if value > 1 else value + 1
                s, e = off.span(node)

                def edit(n: ast.AST, v: int = new_value) -> ast.AST:
                    assert isinstance(n, ast.Constant)
                    n.value = v
                    return n

                def text(src: str, s: int = s, e: int = e, v: int = new_value) -> str | None:
                    if not re.fullmatch(r"[0-9_]+|0[xXoObB][0-9a-fA-F_]+", src[s:e]):
                        return None
                    return src[:s] + str(v) + src[e:]

                yield _Site(node, func_name, edit, text, f"the constant {value} became {new_value}")


class DropBranch(Mutator):
    """Delete an ``if`` statement without ``else`` (a guard, a special case) from a function body."""

    name = "drop_branch"
    summary = "remove an if-statement"

    def sites(self, tree: ast.Module, off: _Offsets) -> Iterator[_Site]:
        for func_name, func in _functions(tree):
            for node in _own_nodes(func):
                for field in ("body", "orelse", "finalbody"):
                    stmts = getattr(node, field, None)
                    if not isinstance(stmts, list):
                        continue
                    for i, stmt in enumerate(stmts):
                        if not isinstance(stmt, ast.If) or stmt.orelse or len(stmts) < 2:
                            continue
                        yield self._site(node, field, i, stmt, func_name, off)
            # Top-level statements of the function body itself.
            body = func.body
            for i, stmt in enumerate(body):
                if isinstance(stmt, ast.If) and not stmt.orelse and len(body) >= 2:
                    yield self._site(func, "body", i, stmt, func_name, off)

    def _site(self, parent: ast.AST, field: str, index: int, stmt: ast.If, func: str, off: _Offsets) -> _Site:
        first = stmt.lineno
        last = stmt.end_lineno or stmt.lineno

        def edit(n: ast.AST, field: str = field, index: int = index) -> ast.AST:
            del getattr(n, field)[index]
            return n

        def text(src: str, first: int = first, last: int = last, col: int = stmt.col_offset) -> str | None:
            lines = src.splitlines(keepends=True)
            head = lines[first - 1]
            if head[:col].strip() or not head[col:].startswith("if"):
                return None  # not alone on its line (e.g. ``elif``, or ``x; if``)
            return "".join(lines[: first - 1] + lines[last:])

        return _Site(parent, func, edit, text, "an if-statement was removed", lineno=first, end_lineno=first)


MUTATORS: dict[str, Mutator] = {
    m.name: m
    for m in (FlipComparison(), OffByOne(), SwapOperands(), ChangeOperator(), WrongConstant(), DropBranch())
}


def _locate(tree: ast.AST, target: ast.AST) -> list[tuple[str, int | None]]:
    """The path of field names/indices from ``tree`` to ``target`` (to find it again in a copy)."""
    for field, value in ast.iter_fields(tree):
        if value is target:
            return [(field, None)]
        if isinstance(value, list):
            for i, item in enumerate(value):
                if item is target:
                    return [(field, i)]
                if isinstance(item, ast.AST):
                    sub = _locate(item, target)
                    if sub:
                        return [(field, i), *sub]
        elif isinstance(value, ast.AST):
            sub = _locate(value, target)
            if sub:
                return [(field, None), *sub]
    return []


def _follow(tree: ast.AST, path: list[tuple[str, int | None]]) -> ast.AST:
    node = tree
    for field, index in path:
        value = getattr(node, field)
        node = value[index] if index is not None else value
    return node


# CPython 3.11's AST constructor keeps a recursion counter that concurrent parses in threads corrupt
# ("SystemError: AST constructor recursion depth mismatch"); builds parse packages from worker threads.
_AST_LOCK = threading.Lock()


def find_mutations(source: str, path: str, mutators: list[str] | None = None) -> list[Mutation]:
    """Every verified single-site mutation of ``source`` (a module at ``path``) by the given mutators."""
    return [m for m in candidate_mutations(source, path, mutators) if m.verify()]


def candidate_mutations(source: str, path: str, mutators: list[str] | None = None) -> list[Mutation]:
    """Every single-site rewrite of ``source``, not yet verified (cheap: one parse per module; a build
    verifies only the candidates it tries, with :meth:`Mutation.verify`)."""
    with _AST_LOCK:
        try:
            tree = ast.parse(source)
        except SyntaxError:
            return []
        off = _Offsets(source)
        functions: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        for qualname, node in _functions(tree):
            functions.setdefault(qualname, []).append(node)
        names: dict[str, tuple[str, ...]] = {}
        out: list[Mutation] = []
        for name in mutators or list(MUTATORS):
            for site in MUTATORS[name].sites(tree, off):
                mutated = site.text(source)
                if mutated is None or mutated == source:
                    continue
                lineno = site.lineno or getattr(site.node, "lineno", 0)
                func = next(
                    (f for f in functions.get(site.func, []) if f.lineno <= lineno <= (f.end_lineno or 0)),
                    None,
                )
                if func is None:
                    continue
                if site.func not in names:
                    names[site.func] = function_names(tree, site.func)
                out.append(
                    Mutation(
                        mutator=name,
                        file=path,
                        function=site.func,
                        functions=names[site.func],
                        lineno=lineno,
                        end_lineno=site.end_lineno or getattr(site.node, "end_lineno", 0) or lineno,
                        description=site.description,
                        original=source,
                        mutated=mutated,
                        _check=_Check(tree, func, site),
                    )
                )
        return out


class _Check:
    """Verifies a rewrite: the mutated module parses, and the mutated function's AST equals the original
    function's with exactly the site's edit applied (the text outside the function is untouched by
    construction, and checked too)."""

    def __init__(self, tree: ast.Module, func: ast.FunctionDef | ast.AsyncFunctionDef, site: _Site) -> None:
        self.tree, self.func, self.site = tree, func, site
        self.result: bool | None = None

    def __call__(self, original: str, mutated: str) -> bool:
        if self.result is None:
            with _AST_LOCK:
                self.result = self._check(original, mutated)
        return self.result

    def _check(self, original: str, mutated: str) -> bool:
        off = _Offsets(original)
        first = self.func.decorator_list[0].lineno if self.func.decorator_list else self.func.lineno
        start = off.starts[first - 1]
        end = off.starts[self.func.end_lineno or self.func.lineno]
        tail = len(original) - end
        if mutated[:start] != original[:start] or mutated[len(mutated) - tail :] != original[end:]:
            return False
        try:
            got = ast.parse(mutated)
        except SyntaxError:
            return False
        where = _locate(self.tree, self.func)
        inner = _locate(self.func, self.site.node) if self.site.node is not self.func else []
        if not where or (self.site.node is not self.func and not inner):
            return False
        expected = copy.deepcopy(self.func)
        self.site.edit(_follow(expected, inner))
        try:
            got_func = _follow(got, where)
        except (AttributeError, IndexError):
            return False
        got_dump = ast.dump(got_func)
        return got_dump == ast.dump(expected) and got_dump != ast.dump(self.func)


def changed_lines(m: Mutation) -> list[str]:
    """The original lines the mutation changed or removed (what must not be findable in an image)."""
    import difflib

    old, new = m.original.splitlines(), m.mutated.splitlines()
    out: list[str] = []
    for tag, i1, i2, _, _ in difflib.SequenceMatcher(a=old, b=new, autojunk=False).get_opcodes():
        if tag in ("replace", "delete"):
            out.extend(old[i1:i2])
    return out
