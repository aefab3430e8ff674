"""The source code the ``swe-mini`` curriculum is built from: small, self-contained Python modules, each
with its test cases, stored as data (one TOML file per module in ``corpus/``).

A module is a few pure functions (standard library only); every function stands alone (it calls no other
function of its module), so it also makes a one-function module of its own, the curriculum's first rung.
Every case is one call of one function and the value it must return (``assert CALL == EXPECTED``); the
builder turns them into a test file per function. Each module names its split (``train`` or ``test``):
held-out code is code the policy never saw.

:func:`load_corpus` reads and checks the files; :func:`check_cases` runs every case against the correct
code (in a subprocess with a time limit) so a wrong ``expected`` is caught before any build.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Literal

from raas.errors import RaasError

Split = Literal["train", "test"]
SPLITS: tuple[Split, ...] = ("train", "test")
MIN_CASES = 3
_KEYS = {"module", "split", "source", "case"}


@dataclass(frozen=True)
class Case:
    function: str
    call: str
    expected: str


@dataclass(frozen=True)
class Function:
    name: str
    source: str
    """The function's own text (decorators and docstring included), dedented to the module level."""
    cases: tuple[Case, ...]


@dataclass(frozen=True)
class Module:
    name: str
    split: Split
    source: str
    imports: str
    """The module's top-level import lines (a one-function module made from it keeps them)."""
    functions: tuple[Function, ...]

    def standalone(self, function: Function) -> str:
        """The one-function module of ``function``: the module's imports and the function."""
        head = f"{self.imports}\n\n\n" if self.imports else ""
        return head + function.source.rstrip("\n") + "\n"


def _bad(path: str, message: str) -> RaasError:
    return RaasError(f"swe-mini corpus {path}: {message}", kind="bad_request")


def _called_function(path: str, call: str) -> str:
    try:
        node = ast.parse(call, mode="eval").body
    except SyntaxError as e:
        raise _bad(path, f"case call {call!r} is not an expression: {e.msg}") from e
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
        raise _bad(path, f"case call {call!r} must be a call of one of the module's functions")
    return node.func.id


def parse_module(text: str, path: str = "<corpus>") -> Module:
    """One corpus file's module, checked (see the module docstring); ``bad_request`` says what is wrong."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise _bad(path, f"not TOML: {e}") from e
    unknown = set(data) - _KEYS
    if unknown or not _KEYS <= set(data):
        raise _bad(path, f"keys must be exactly {sorted(_KEYS)}, got {sorted(data)}")
    name, split, source = data["module"], data["split"], data["source"]
    if not (isinstance(name, str) and name.isidentifier() and name.islower()):
        raise _bad(path, f"module {name!r} must be a lower-case identifier")
    if name in sys.stdlib_module_names or name.startswith("test"):
        raise _bad(path, f"module {name!r} would shadow a standard-library module or look like a test")
    if split not in SPLITS:
        raise _bad(path, f"split must be one of {SPLITS}, got {split!r}")
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        raise _bad(path, f"source does not parse: {e}") from e
    lines = source.splitlines()
    imports: list[str] = []
    defs: dict[str, ast.FunctionDef] = {}
    for i, node in enumerate(tree.body):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and i == 0:
            continue  # the module docstring
        if isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                top = (getattr(node, "module", None) or alias.name).split(".")[0]
                if top not in sys.stdlib_module_names:
                    raise _bad(path, f"imports {top!r}: only the standard library may be imported")
            imports.extend(lines[node.lineno - 1 : node.end_lineno])
        elif isinstance(node, ast.FunctionDef):
            if node.name in defs:
                raise _bad(path, f"function {node.name} is defined twice")
            defs[node.name] = node
        else:
            raise _bad(path, f"line {node.lineno}: only a docstring, imports and functions may be top level")
    if not defs:
        raise _bad(path, "the module defines no function")
    functions: list[Function] = []
    cases_by_fn: dict[str, list[Case]] = {n: [] for n in defs}
    raw_cases = data["case"]
    if not isinstance(raw_cases, list):
        raise _bad(path, "case must be an array of tables")
    for c in raw_cases:
        if not (isinstance(c, dict) and set(c) == {"call", "expected"}):
            raise _bad(path, f"a case has exactly call and expected, got {c!r}")
        if not all(isinstance(c[k], str) and c[k].strip() for k in ("call", "expected")):
            raise _bad(path, f"call and expected must be non-empty strings, got {c!r}")
        fn = _called_function(path, c["call"])
        if fn not in defs:
            raise _bad(path, f"case call {c['call']!r} does not call a function of the module")
        try:
            ast.parse(c["expected"], mode="eval")
        except SyntaxError as e:
            raise _bad(path, f"expected {c['expected']!r} is not an expression") from e
        cases_by_fn[fn].append(Case(fn, c["call"], c["expected"]))
    for fn_name, node in defs.items():
        others = set(defs) - {fn_name}
        used = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} & others
        if used:
            raise _bad(path, f"{fn_name} calls {sorted(used)}: every function must stand alone")
        if fn_name in sys.stdlib_module_names or fn_name.startswith("test"):
            raise _bad(path, f"function {fn_name!r} would shadow a standard-library module as a file name")
        if len(cases_by_fn[fn_name]) < MIN_CASES:
            raise _bad(path, f"{fn_name} has {len(cases_by_fn[fn_name])} cases; at least {MIN_CASES}")
        first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        text = "\n".join(lines[first - 1 : node.end_lineno]) + "\n"
        functions.append(Function(fn_name, text, tuple(cases_by_fn[fn_name])))
    return Module(
        name, split, source if source.endswith("\n") else source + "\n", "\n".join(imports), tuple(functions)
    )


def corpus_dir() -> Path:
    return Path(str(resources.files("raas.tasks.swe.mini") / "corpus"))


@cache
def load_corpus(directory: str | None = None) -> tuple[Module, ...]:
    """Every module of the corpus (sorted by name), checked together: module and function names are
    unique across the corpus (each names a file of its own)."""
    root = Path(directory) if directory else corpus_dir()
    modules = [parse_module(p.read_text(encoding="utf-8"), p.name) for p in sorted(root.glob("*.toml"))]
    seen: dict[str, str] = {}
    for m in modules:
        for name in (m.name, *(f.name for f in m.functions)):
            if name in seen and not (name == m.name and seen[name] == m.name):
                raise _bad(m.name, f"the name {name!r} is used by {seen[name]} too")
            seen[name] = m.name
    return tuple(sorted(modules, key=lambda m: m.name))


_CHECK = """
import json, sys
source, cases = json.loads(sys.stdin.read())
ns = {"__name__": "corpus_check"}
exec(compile(source, "<module>", "exec"), ns)
bad = []
for call, expected in cases:
    try:
        got = eval(call, dict(ns))
        want = eval(expected, dict(ns))
        if not (type(got) is type(want) and got == want):
            bad.append([call, repr(got), expected])
    except Exception as e:
        bad.append([call, "raised %s: %s" % (type(e).__name__, e), expected])
print(json.dumps(bad))
"""


def check_cases(module: Module, timeout_s: float = 30.0) -> list[tuple[str, str, str]]:
    """Cases the correct code fails, as ``(call, what it gave, expected)``; empty when all pass. A result
    must also have the expected value's type (``1 == 1.0`` and ``True == 1`` are not what a case means)."""
    payload = json.dumps([module.source, [[c.call, c.expected] for f in module.functions for c in f.cases]])
    out = subprocess.run(
        [sys.executable, "-I", "-c", _CHECK],
        input=payload,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if out.returncode != 0:
        return [("<module>", out.stderr.strip()[-500:], "to run")]
    return [(str(a), str(b), str(c)) for a, b, c in json.loads(out.stdout)]


def kill_report(module: Module, timeout_s: float = 10.0) -> dict[str, tuple[int, int]]:
    """Per function: (single-site bugs the builder may try, how many of them fail at least one of its
    cases). A function whose cases catch few of its bugs yields few
    instances. Runs each bug's cases in a subprocess (a bug may loop forever: it then counts as caught)."""
    from raas.tasks.swe.mutate import candidate_mutations

    out: dict[str, tuple[int, int]] = {}
    for fn in module.functions:
        source = module.standalone(fn)
        bugs = [m for m in candidate_mutations(source, f"{fn.name}.py") if m.verify()]
        caught = 0
        for m in bugs:
            mutated = Module(module.name, module.split, m.mutated, module.imports, (fn,))
            try:
                failing = check_cases(mutated, timeout_s)
            except subprocess.TimeoutExpired:
                caught += 1
                continue
            if failing:
                caught += 1
        out[fn.name] = (len(bugs), caught)
    return out
