"""The swe-mini curriculum's source data and how instances are written from it (no sandbox needed):
the validator refuses what the builder could not use, the corpus itself passes it, and the issue texts,
test files and the teacher's edits come out as the curriculum promises."""

from __future__ import annotations

import pytest

from raas.errors import RaasError
from raas.tasks.swe.mini.build import LEVELS, Target, cases_module_text, named_statement, split_records
from raas.tasks.swe.mini.corpus import check_cases, load_corpus, parse_module
from raas.tasks.swe.mini.teacher import gold_edit
from raas.tasks.swe.records import SweRecord

pytestmark = pytest.mark.unit

GOOD = """module = "widgets"
split = "train"
source = '''
\"\"\"Widgets.\"\"\"
import math


def widget_area(w, h):
    \"\"\"Area.\"\"\"
    if w < 0 or h < 0:
        return 0
    return w * h
'''

[[case]]
call = "widget_area(2, 3)"
expected = "6"

[[case]]
call = "widget_area(-1, 3)"
expected = "0"

[[case]]
call = "widget_area(0, 3)"
expected = "0"
"""


def with_source(source: str, cases: str | None = None) -> str:
    head = GOOD.split("source = '''")[0]
    tail = GOOD.split("'''", 2)[2] if cases is None else cases
    return head + "source = '''\n" + source + "'''\n" + tail


def test_a_good_module_parses_and_its_cases_pass() -> None:
    m = parse_module(GOOD)
    assert m.name == "widgets" and m.split == "train" and [f.name for f in m.functions] == ["widget_area"]
    assert m.imports == "import math" and len(m.functions[0].cases) == 3
    assert m.standalone(m.functions[0]).startswith("import math\n\n\ndef widget_area(w, h):\n")
    assert check_cases(m) == []


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        (GOOD.replace('split = "train"', 'split = "dev"'), "split must be one of"),
        (GOOD.replace('module = "widgets"', 'module = "json"'), "shadow a standard-library module"),
        (GOOD.replace("import math", "import numpy"), "only the standard library"),
        (GOOD + '\n[[case]]\ncall = "len([])"\nexpected = "0"\n', "does not call a function of the module"),
        (GOOD + '\n[[case]]\ncall = "widget_area(1, 1) + 1"\nexpected = "2"\n', "must be a call"),
        (GOOD.replace('expected = "6"', 'expected = "6", note = "x"'), "not TOML"),
        (GOOD.replace("widget_area(-1, 3)", "widget_area(-1, 3"), "not an expression"),
        (
            with_source(
                "def widget_area(w, h):\n    return helper(w) * h\n\n\ndef helper(w):\n    return w\n"
            ),
            "every function must stand alone",
        ),
        (
            with_source("X = 3\n\n\ndef widget_area(w, h):\n    return w * h\n"),
            "only a docstring, imports and functions",
        ),
        (
            GOOD.split("[[case]]")[0] + '[[case]]\ncall = "widget_area(1, 1)"\nexpected = "1"\n',
            "has 1 cases; at least 3",
        ),
    ],
)
def test_what_the_builder_could_not_use_is_refused(text: str, problem: str) -> None:
    with pytest.raises(RaasError) as e:
        parse_module(text, "widgets.toml")
    assert e.value.kind == "bad_request" and problem in e.value.message


def test_a_wrong_expected_value_is_caught_and_a_type_mismatch_too() -> None:
    m = parse_module(
        GOOD.replace('expected = "6"', 'expected = "7"').replace('expected = "0"', 'expected = "0.0"', 1)
    )
    bad = check_cases(m)
    assert ("widget_area(2, 3)", "6", "7") in bad and ("widget_area(-1, 3)", "0", "0.0") in bad


def test_the_corpus_passes_the_validator_and_its_splits_share_no_module() -> None:
    modules = load_corpus()
    splits = {m.split for m in modules}
    assert splits == {"train", "test"}
    names = [f.name for m in modules for f in m.functions]
    assert len(names) == len(set(names)) and len(names) >= 150
    for m in modules:
        assert check_cases(m) == [], m.name


def test_test_files_and_the_named_issue() -> None:
    m = parse_module(GOOD)
    fn = m.functions[0]
    src = cases_module_text("widget_area", fn)
    assert "from widget_area import widget_area\n" in src
    assert "def test_widget_area_2():\n    assert widget_area(-1, 3) == 0\n" in src
    t = Target("function", m, fn)
    assert t.file == "widget_area.py" and set(t.files()) == {"widget_area.py", "tests/test_widget_area.py"}
    assert Target("module", m, fn).file == "widgets.py"
    text = named_statement(
        t,
        [
            ("widget_area(2, 3)", "5", "6"),
            ("widget_area(-1, 3)", "raises ValueError: no", "0"),
            ("widget_area(0, 3)", "1", "0"),
        ],
    )
    assert text == (
        "Bug in `widget_area` (file `widget_area.py`):\n"
        "`widget_area(2, 3)` returns 5, expected 6.\n"
        "`widget_area(-1, 3)` raises ValueError: no, expected 0.\n"
    )


def record(iid: str, level: str, split: str) -> SweRecord:
    return SweRecord(
        instance_id=iid,
        repo="swe-mini/x",
        base_commit="0" * 40,
        problem_statement="p",
        patch="",
        test_patch="",
        FAIL_TO_PASS=["t"],
        PASS_TO_PASS=[],
        version="1",
        environment_setup_commit="0" * 40,
        created_at="2026-01-01T00:00:00Z",
        data_source="swe-mini",
        image="/x",
        test_cmd="true",
        level=level,
        split=split,
    )


def test_a_split_prefix_mixes_the_levels_and_never_crosses_splits() -> None:
    records = [record(f"{lv}-{i}-{s}", lv, s) for lv in LEVELS for i in range(4) for s in ("train", "test")]
    rows = split_records(records, "test")
    assert len(rows) == 12 and {r["split"] for r in rows} == {"test"}
    assert [r["level"] for r in rows[:3]] == list(LEVELS)
    assert [r["level"] for r in split_records(records, "train", ("module",))] == ["module"] * 4
    assert split_records(records, "test") == rows  # a fixed order


@pytest.mark.parametrize(
    ("buggy_line", "fixed_line", "edit"),
    [
        ("    return w + h", "    return w * h", ("return w + h", "return w * h")),
        ("    if w <= 0:", "    if w < 0:", ("if w <= 0:", "if w < 0:")),
    ],
)
def test_the_teachers_edit_is_the_smallest_unique_text(
    buggy_line: str, fixed_line: str, edit: tuple[str, str]
) -> None:
    buggy = f"def f(w, h):\n{buggy_line}\n    return 0\n"
    assert gold_edit(buggy, buggy.replace(buggy_line, fixed_line)) == edit


def test_a_repeated_line_gets_the_lines_before_it() -> None:
    buggy = "def f(x):\n    if x:\n        return 1\n    y = 2\n    if x:\n        return 1\n"
    fixed = "def f(x):\n    if x:\n        return 1\n    y = 2\n    if x:\n        return 2\n"
    assert gold_edit(buggy, fixed) == (
        "    y = 2\n    if x:\n        return 1",
        "    y = 2\n    if x:\n        return 2",
    )
    assert gold_edit(buggy, buggy) is None
