"""The built-in math set and user dataset files."""

from __future__ import annotations

import json
import re
from fractions import Fraction
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raas.errors import RaasError
from raas.tasks.datasets import BUILTIN_MATH_DEFAULT_N, builtin_math, load_dataset, load_file
from raas.tasks.stem.answers import parse as stem_parse

pytestmark = pytest.mark.unit


def test_builtin_has_at_least_50_distinct_problems_and_is_deterministic() -> None:
    a, b = builtin_math(64), builtin_math(64)
    assert a == b
    assert len({x["problem"] for x in a}) == 64
    assert len({x["instance_id"] for x in a}) == 64
    assert all(x["data_source"] == "math" and x["answer"] for x in a)
    assert builtin_math(10) == a[:10]  # prefix-stable: a small run is a subset of a large one


def test_builtin_answers_are_recomputable_from_the_text() -> None:
    """Re-derive answers of two templates from the problem text alone, independently of the generator."""
    checked = 0
    for inst in builtin_math(120):
        p = inst["problem"]
        m = re.match(r"\w+ has (\d+) dollars and buys (\d+) \w+ that cost (\d+) dollars", p)
        if m:
            money, n, price = map(int, m.groups())
            assert Fraction(inst["answer"]) == money - n * price
            checked += 1
        m = re.search(r"fills a tank in (\d+) hours and another fills it in (\d+) hours", p)
        if m:
            x, y = map(int, m.groups())
            assert Fraction(inst["answer"]) == Fraction(x * y, x + y)
            checked += 1
        m = re.search(r"has (\d+) quarters, (\d+) dimes and (\d+) nickels", p)
        if m:
            q, d, n = map(int, m.groups())
            assert Fraction(inst["answer"]) == 25 * q + 10 * d + 5 * n
            checked += 1
        m = re.search(r"scored ([\d, ]+) on the first \d+ tests.*all (\d+) tests to be exactly (\d+)", p)
        if m:
            scores = [int(x) for x in m.group(1).split(",")]
            n, target = int(m.group(2)), int(m.group(3))
            need = Fraction(inst["answer"])
            assert (sum(scores) + need) / n == target and 60 <= need <= 100
            checked += 1
    assert checked >= 35


def test_builtin_names() -> None:
    assert len(load_dataset("builtin:math")) == BUILTIN_MATH_DEFAULT_N
    assert len(load_dataset("builtin:math:50")) == 50
    for bad in ("builtin:gsm", "builtin:math:x", "builtin:math:0", "builtin:math:100000"):
        with pytest.raises(RaasError) as e:
            load_dataset(bad)
        assert e.value.kind == "bad_request"


def test_jsonl_and_parquet_in_the_deepscaler_shape(tmp_path: Path) -> None:
    rows = [{"problem": "1+1?", "answer": "2", "solution": "..."}, {"problem": "2*3?", "answer": 6}]
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    pqf = tmp_path / "d.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"problem": "1+1?", "answer": "2"}, {"problem": "2*3?", "answer": "6"}]), pqf
    )
    for f in (jl, pqf):
        got = load_dataset(str(f))
        assert [g["problem"] for g in got] == ["1+1?", "2*3?"]
        assert [g["answer"] for g in got] == ["2", "6"]
        assert all(g["data_source"] == "math" for g in got)
        assert len({g["instance_id"] for g in got}) == 2
    assert load_file(jl)[0]["solution"] == "..."


def test_a_parquet_file_mixing_tasks_gives_each_row_its_own(tmp_path: Path) -> None:
    """Parquet gives every row every column, null where the row has none: a null is not a field."""
    rows = [
        {"problem": "6*7?", "answer": "42"},
        {"question": "Which is a gas at room temperature?", "choices": ["iron", "helium"], "answer": "B"},
        {"question": "How many legs has a spider?", "answer": "8"},
    ]
    pqf = tmp_path / "mixed.parquet"
    columns = sorted({k for r in rows for k in r})
    pq.write_table(pa.Table.from_pydict({c: [r.get(c) for r in rows] for c in columns}), pqf)
    got = load_dataset(str(pqf))
    assert got[0]["choices"] is None and got[1]["problem"] is None  # what parquet hands back
    assert [g["data_source"] for g in got] == ["math", "stem", "stem"]
    specs = [stem_parse(g) for g in got[1:]]
    assert [s.gold for s in specs] == ["B", "8"] and specs[0].choices == ("iron", "helium")


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("bad.jsonl", '{"problem": "x", "answer": "1"}\n{not json\n'),
        ("rows.jsonl", '{"question": "x"}\n'),
        ("scalar.jsonl", "3\n"),
        ("d.json", '{"a": 1}'),
        ("d.csv", "problem,answer\n"),
        ("d.parquet", "not parquet"),
    ],
)
def test_bad_files_are_typed_errors(tmp_path: Path, name: str, content: str) -> None:
    f = tmp_path / name
    f.write_text(content)
    with pytest.raises(RaasError) as e:
        load_dataset(str(f))
    assert e.value.kind == "bad_request"


def test_missing_file() -> None:
    with pytest.raises(RaasError) as e:
        load_dataset("/nonexistent/data.jsonl")
    assert e.value.kind == "bad_request"


def test_builtin_humaneval_and_stem() -> None:
    assert len(load_dataset("builtin:humaneval")) == 164
    few = load_dataset("builtin:humaneval:3")
    assert [p["instance_id"] for p in few] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert all(p["data_source"] == "code" and "def check" in p["test"] for p in few)
    assert len(load_dataset("builtin:stem")) == 16
    assert len(load_dataset("builtin:stem:40")) == 40
    for bad in ("builtin:humaneval:165", "builtin:humaneval:0", "builtin:stem:x", "builtin:stem:501"):
        with pytest.raises(RaasError) as e:
            load_dataset(bad)
        assert e.value.kind == "bad_request"


def test_rows_without_data_source_are_routed_by_their_shape(tmp_path: Path) -> None:
    rows = [
        {"problem": "1+1?", "answer": 2},
        {"question": "Which is a noble gas?", "choices": ["neon", "iron"], "answer": 0},
        {"question": "Symbol of gold?", "answer": "Au"},
        {"problem": "Print the sum.", "inputs": ["1 2\n"], "outputs": ["3\n"]},
        {"problem": "Echo.", "tests": '[{"input": "x", "output": "x"}]'},
        {"prompt": "def f():\n", "entry_point": "f", "test": "def check(c): pass"},
        {"problem": "Anything", "answer": "1", "data_source": "stem"},
    ]
    f = tmp_path / "mixed.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows))
    got = load_dataset(str(f))
    assert [g["data_source"] for g in got] == ["math", "stem", "stem", "code", "code", "code", "stem"]
    assert got[0]["answer"] == "2"  # math answers become strings
    assert got[1]["answer"] == 0  # a multiple-choice index stays an index
    # A data_source given for the file applies to rows without their own.
    assert {g["data_source"] for g in load_file(f, data_source="stem")[:6]} == {"stem"}
