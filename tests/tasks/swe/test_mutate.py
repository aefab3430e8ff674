"""The bug injectors: one site per mutation, formatting kept, each kind able to make a test fail."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import textwrap
from typing import Any

import pytest

from raas.tasks.swe.mutate import MUTATORS, Mutation, candidate_mutations, changed_lines, find_mutations

pytestmark = pytest.mark.unit

MODULE = textwrap.dedent(
    '''\
    """A module with one function per kind of bug."""

    LIMIT = 10  # module level: never mutated


    def clamp(n, low, high):
        """Docstring with a < b and 1 + 1 (never mutated)."""
        if n < low:  # a guard
            return low
        return min(n, high)


    def distance(a, b):
        return a - b


    def total(xs):
        acc = 0
        for x in xs:
            acc = acc + x
        return acc


    def both(a, b):
        return a and b


    def scale(x):
        return x * 3


    class Box:
        def is_empty(self, items):
            return len(items) == 0
    '''
)


def _run(source: str, call: str) -> Any:
    ns: dict[str, Any] = {}
    exec(compile(source, "<mutant>", "exec"), ns)
    return eval(call, ns)


def _functions(source: str) -> dict[str, str]:
    return {n.name: ast.dump(n) for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef)}


def _diff(m: Mutation) -> list[str]:
    return [
        line
        for line in difflib.unified_diff(m.original.splitlines(), m.mutated.splitlines(), lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]


# Each kind: the exact text change, and an input on which the mutant behaves differently.
CASES = [
    (
        "flip_comparison",
        "clamp",
        ["-    if n < low:  # a guard", "+    if n >= low:  # a guard"],
        "clamp(-5, 0, 9)",
    ),
    ("off_by_one", "clamp", ["-    if n < low:  # a guard", "+    if n <= low:  # a guard"], None),
    ("swap_operands", "distance", ["-    return a - b", "+    return b - a"], "distance(5, 2)"),
    ("change_operator", "total", ["-        acc = acc + x", "+        acc = acc - x"], "total([1, 2])"),
    ("change_operator", "both", ["-    return a and b", "+    return a or b"], "both(1, 0)"),
    ("wrong_constant", "scale", ["-    return x * 3", "+    return x * 2"], "scale(1)"),
    ("drop_branch", "clamp", ["-    if n < low:  # a guard", "-        return low"], "clamp(-5, 0, 9)"),
    (
        "flip_comparison",
        "Box.is_empty",
        ["-        return len(items) == 0", "+        return len(items) != 0"],
        "Box().is_empty([])",
    ),
]


@pytest.mark.parametrize(("mutator", "function", "diff", "call"), CASES)
def test_each_kind_rewrites_one_site_and_changes_behaviour(
    mutator: str, function: str, diff: list[str], call: str | None
) -> None:
    mutations = [m for m in find_mutations(MODULE, "pkg/mod.py", [mutator]) if m.function == function]
    matching = [m for m in mutations if _diff(m) == diff]
    assert matching, [(_diff(m)) for m in mutations]
    m = matching[0]
    assert m.mutator == mutator and m.file == "pkg/mod.py"
    # Only that site changed: every other line, comments included, is byte-identical.
    assert len(m.mutated.splitlines()) >= len(m.original.splitlines()) - 2
    if call is not None:  # the mutant is observably wrong: a test of this call fails
        assert _run(m.original, call) != _run(m.mutated, call)
    # The AST differs from the original in exactly one function.
    old, new = _functions(m.original), _functions(m.mutated)
    assert old.keys() == new.keys()
    assert [name for name in old if old[name] != new[name]] == [function.split(".")[-1]]


def test_off_by_one_moves_the_boundary() -> None:
    m = next(m for m in find_mutations(MODULE, "pkg/mod.py", ["off_by_one"]) if m.function == "clamp")
    assert _run(m.original, "clamp(0, 0, 9)") == 0
    assert _run(m.mutated, "clamp(0, 0, 9)") == 0  # the boundary value itself...
    src = m.mutated.replace("return low", "return 'low'")
    assert _run(src, "clamp(0, 0, 9)") == "low"  # ...now takes the guard branch


def test_every_mutator_has_a_case() -> None:
    assert {c[0] for c in CASES} | {"off_by_one"} == set(MUTATORS)


def test_docstrings_module_level_code_and_defaults_are_never_touched() -> None:
    for m in find_mutations(MODULE, "pkg/mod.py"):
        removed = changed_lines(m)
        assert removed, m
        assert not any("LIMIT" in line or '"""' in line for line in removed), m
        assert m.function  # always inside a function


def test_every_mutation_parses_and_is_one_change(tmp_path: Any) -> None:
    ms = find_mutations(MODULE, "pkg/mod.py")
    assert len({m.key for m in ms}) == len(ms) >= 10
    for m in ms:
        ast.parse(m.mutated)
        assert m.mutated != m.original
        assert len(changed_lines(m)) <= 2  # one expression, or one if-statement of two lines


def test_sites_that_cannot_be_rewritten_exactly_are_skipped() -> None:
    src = textwrap.dedent(
        """\
        def f(a, b, c):
            x = (a + b) - c
            y = (a  # comment
                 < b)
            return x, y
        """
    )
    ms = find_mutations(src, "m.py")
    # swapping `(a + b) - c` by text would need new parentheses: skipped, not mangled
    assert not [m for m in ms if m.mutator == "swap_operands"]
    # a comment between the operands: the operator is not edited by text
    assert not [m for m in ms if m.mutator in ("flip_comparison", "off_by_one")]
    for m in ms:
        ast.parse(m.mutated)


def test_no_functions_no_mutations() -> None:
    assert find_mutations("X = 1 + 2\nif X > 2:\n    Y = 3\n", "m.py") == []
    assert find_mutations("def broken(:\n", "m.py") == []


def test_unicode_columns_are_handled() -> None:
    src = 'def f(s):\n    return "é" + s if len(s) < 3 else s\n'
    ms = find_mutations(src, "m.py", ["flip_comparison"])
    assert [_diff(m) for m in ms] == [
        ['-    return "é" + s if len(s) < 3 else s', '+    return "é" + s if len(s) >= 3 else s']
    ]


def test_candidates_are_verified_before_use() -> None:
    cands = candidate_mutations(MODULE, "pkg/mod.py")
    assert len(cands) == len(find_mutations(MODULE, "pkg/mod.py"))  # every text edit here is exact
    m = next(c for c in cands if c.mutator == "swap_operands")
    assert m.verify()

    def variant(text: str) -> Mutation:
        check = m._check
        assert check is not None
        return dataclasses.replace(m, mutated=text, _check=type(check)(check.tree, check.func, check.site))

    # A rewrite that also changes something else in the function, or outside it, is refused.
    assert not variant(m.mutated.replace("return b - a", "return b - a - 0")).verify()
    assert not variant(m.mutated.replace("LIMIT = 10", "LIMIT = 11")).verify()
    assert not variant(m.mutated.replace("return b - a", "return b -")).verify()
    assert variant(m.mutated).verify()
