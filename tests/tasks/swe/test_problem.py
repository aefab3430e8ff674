"""Problem statements: written from the failing tests, never naming where the bug is."""

from __future__ import annotations

import re

import pytest

from raas.tasks.swe.problem import failure_sections, secrets_for, write_problem_statement

pytestmark = pytest.mark.unit

# pytest --tb=short output of a bug in cachetools' LRUCache.popitem (shape of a real run, trimmed).
LOG = """\
============================= test session starts ==============================
collected 3 items

tests/test_lru.py F.F                                                    [100%]

=================================== FAILURES ===================================
________________________ LRUCacheTest.test_lru_insert __________________________
tests/__init__.py:120: in test_cache_insert
    cache[3] = 3
src/cachetools/__init__.py:88: in __setitem__
    self.popitem()
src/cachetools/__init__.py:301: in popitem
    key = next(iter(self.__order))
E   KeyError: 'popitem(): LRUCache is empty'
_____________________ LRUCacheTest.test_lru_getsizeof[big] _____________________
tests/test_lru.py:40: in test_lru_getsizeof
    self.assertEqual(len(cache), 2)
    ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
E   AssertionError: 3 != 2
==================================== PASSES ====================================
=========================== short test summary info ============================
FAILED tests/test_lru.py::LRUCacheTest::test_lru_insert - KeyError: 'popitem(): LRUCache is empty'
PASSED tests/test_lru.py::LRUCacheTest::test_lru
FAILED tests/test_lru.py::LRUCacheTest::test_lru_getsizeof[big] - AssertionError: 3 != 2
========================= 2 failed, 1 passed in 0.05s ==========================
"""
FAILING = [
    "tests/test_lru.py::LRUCacheTest::test_lru_insert",
    "tests/test_lru.py::LRUCacheTest::test_lru_getsizeof[big]",
]
TEST_FILES = {"tests/__init__.py", "tests/test_lru.py"}


def _mentions(text: str, allowed: list[str], words: list[str], paths: list[str]) -> list[str]:
    """An independent check: what the text names outside the allowed test ids."""
    for a in allowed:
        text = text.replace(a, "")
    found = [w for w in words if re.search(rf"\b{re.escape(w)}\b", text)]
    return found + [p for p in paths if p in text]


def test_sections_are_keyed_by_the_headline_pytest_prints() -> None:
    sections = failure_sections(LOG)
    assert set(sections) == {"LRUCacheTest.test_lru_insert", "LRUCacheTest.test_lru_getsizeof[big]"}
    assert any("KeyError" in line for line in sections["LRUCacheTest.test_lru_insert"])


def test_statement_names_the_tests_and_their_errors_but_not_the_bug() -> None:
    secrets = secrets_for("src/cachetools/__init__.py", ["popitem"], ["cachetools"])
    text = write_problem_statement("cachetools", FAILING, LOG, TEST_FILES, secrets, seed="x")
    for t in FAILING:
        assert t in text
    assert "AssertionError: 3 != 2" in text  # the assertion message
    assert "self.assertEqual(len(cache), 2)" in text  # the test's own failing line
    assert "cache[3] = 3" in text  # a frame of the test code
    assert "KeyError" in text  # the error kind, even where its message had to go
    assert not _mentions(text, FAILING, ["popitem"], ["cachetools/__init__.py", "src/cachetools"])
    assert "src/cachetools/__init__.py:88" not in text  # no frame inside the package
    assert "^^^" not in text  # position markers are noise


def test_a_test_named_after_the_function_keeps_its_name() -> None:
    log = LOG.replace("test_lru_insert", "test_popitem")
    failing = [FAILING[0].replace("test_lru_insert", "test_popitem"), FAILING[1]]
    secrets = secrets_for("src/cachetools/__init__.py", ["popitem"], ["cachetools"])
    text = write_problem_statement("cachetools", failing, log, TEST_FILES, secrets)
    assert failing[0] in text
    assert not _mentions(text, failing, ["popitem"], ["cachetools/__init__.py"])


def test_test_lines_that_call_the_function_are_left_out() -> None:
    log = LOG.replace("cache[3] = 3", "cache.popitem()")
    secrets = secrets_for("src/cachetools/__init__.py", ["popitem"], ["cachetools"])
    text = write_problem_statement("cachetools", FAILING, log, TEST_FILES, secrets)
    assert "cache.popitem()" not in text
    assert not _mentions(text, FAILING, ["popitem"], [])


def test_the_title_names_the_error_kind() -> None:
    secrets = secrets_for("src/cachetools/__init__.py", ["popitem"], ["cachetools"])
    text = write_problem_statement("cachetools", FAILING, LOG, TEST_FILES, secrets)
    assert text.startswith("cachetools: KeyError in LRUCacheTest.test_lru_insert (and 1 more failing test)")
    bare = LOG.replace("E   KeyError: 'popitem(): LRUCache is empty'", "E   assert 3 == 2")
    assert write_problem_statement("cachetools", FAILING, bare, TEST_FILES, secrets).startswith(
        "cachetools: AssertionError in"
    )


def test_submodule_names_are_secret_but_the_package_name_is_not() -> None:
    s = secrets_for("boltons/iterutils.py", ["chunked", "_inner"], ["boltons"])
    assert set(s.paths) >= {"boltons/iterutils.py", "iterutils.py", "boltons.iterutils"}
    assert "boltons" not in s.paths
    assert s.words == ("chunked", "_inner")
    assert s.leaks("from boltons.iterutils import x", []) == ["boltons.iterutils"]
    assert s.leaks("import boltons", []) == []
