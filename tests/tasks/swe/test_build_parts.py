"""The builder's pure parts and its host-side git work (real git, no sandboxes)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from raas.errors import RaasError
from raas.tasks.swe import repo
from raas.tasks.swe.build import judge, order_candidates, pytest_command
from raas.tasks.swe.coverage import LineCoverage, prioritize
from raas.tasks.swe.mutate import find_mutations
from raas.tasks.swe.packages import PACKAGES, get_package
from raas.tasks.swe.records import SweRecord, validate_record
from raas.tasks.swe.runner import CommandRun

pytestmark = pytest.mark.unit

RUN = CommandRun(exit_code=1, output="", timed_out=False, seconds=1.0)
BASE = {f"t.py::test_{i}": "PASSED" for i in range(30)} | {"t.py::test_skip": "SKIPPED"}
SAFE = set(BASE)


def test_judge_keeps_only_bugs_that_break_a_few_tests_and_nothing_else() -> None:
    two = BASE | {"t.py::test_1": "FAILED", "t.py::test_2": "ERROR"}
    v = judge(BASE, two, SAFE, RUN, 20)
    assert v.reason == "accepted" and v.fail_to_pass == ["t.py::test_1", "t.py::test_2"]
    assert judge(BASE, BASE, SAFE, CommandRun(0, "", False, 1), 20).reason == "no_failure"
    many = BASE | {f"t.py::test_{i}": "FAILED" for i in range(21)}
    assert judge(BASE, many, SAFE, RUN, 20).reason == "too_many_failures"
    gone = {k: v for k, v in BASE.items() if k != "t.py::test_3"}
    assert judge(BASE, gone, SAFE, RUN, 20).reason == "tests_missing"
    skipped = BASE | {"t.py::test_4": "SKIPPED"}
    assert judge(BASE, skipped, SAFE, RUN, 20).reason == "not_a_failure"
    assert judge(BASE, two, SAFE - {"t.py::test_1"}, RUN, 20).reason == "unparseable_test_id"
    assert judge(BASE, two, SAFE, CommandRun(None, "", True, 60), 20).reason == "timeout"
    assert judge(BASE, two, SAFE, CommandRun(2, "", False, 1), 20).reason == "pytest_exit_2"
    # a test that was already skipped before does not count either way
    assert judge(BASE, two | {"t.py::test_skip": "FAILED"}, SAFE, RUN, 20).reason == "accepted"


SRC = """\
def a(x):
    if x < 1:
        return 0
    return x - 1


def b(x, y):
    return x == y
"""


def test_candidate_order_is_deterministic_and_mixes_kinds() -> None:
    ms = find_mutations(SRC, "m.py")
    one, two = order_candidates(ms, 7), order_candidates(ms, 7)
    assert [m.key for m in one] == [m.key for m in two]
    assert sorted(m.key for m in one) == sorted(m.key for m in ms)
    kinds = {m.mutator for m in ms}
    assert {m.mutator for m in one[: len(kinds)]} == kinds  # round-robin: every kind early


def test_coverage_drops_unreached_lines_and_puts_import_time_lines_last() -> None:
    ms = find_mutations(SRC, "m.py")
    cov = LineCoverage({("m.py", 2): (3, False), ("m.py", 4): (500, False), ("m.py", 8): (1, True)})
    ordered = prioritize(ms, cov, 20)
    lines = [m.lineno for m in ordered]
    assert 3 not in lines  # `return 0` is never run... (no mutation there anyway)
    assert lines == sorted(lines, key=lambda n: {2: 0, 4: 1, 8: 2}[n])
    assert prioritize(ms, LineCoverage({}), 20) == []


def test_coverage_output_parses() -> None:
    data = json.dumps({"/testbed/src/p/m.py": {"3": [2, False], "9": [0, True]}})
    cov = LineCoverage.parse(data)
    assert cov.lines == {("src/p/m.py", 3): (2, False), ("src/p/m.py", 9): (0, True)}


def test_test_command_is_quoted_and_lists_every_outcome() -> None:
    cmd = pytest_command(get_package("six"), ["test_six.py", "tests/a b.py"])
    assert cmd.startswith("python3 -B -m pytest -rA ")
    assert "-p no:cacheprovider" in cmd and "--rootdir=/testbed" in cmd
    assert cmd.endswith("test_six.py 'tests/a b.py'")


def test_package_specs_separate_code_from_tests() -> None:
    toolz = get_package("toolz")
    assert toolz.is_source("toolz/itertoolz.py")
    assert not toolz.is_source("toolz/tests/test_itertoolz.py")
    assert not toolz.is_source("toolz/_signatures.py")
    assert toolz.is_test("toolz/tests/test_itertoolz.py")
    cachetools = get_package("cachetools")
    assert cachetools.is_source("src/cachetools/func.py") and not cachetools.is_source("docs/conf.py")
    assert len(PACKAGES) >= 5 and len({p.style for p in PACKAGES.values()}) >= 3
    assert all(len(p.sha256) == 64 for p in PACKAGES.values())
    with pytest.raises(RaasError) as e:
        get_package("left-pad")
    assert e.value.kind == "bad_request"


def _record(**over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "instance_id": "pypi__x-1-00000000",
        "repo": "pypi/x",
        "base_commit": "a" * 40,
        "problem_statement": "tests fail",
        "patch": "diff --git a/x b/x\n",
        "test_patch": "diff --git a/t b/t\n",
        "FAIL_TO_PASS": ["t.py::test_a"],
        "PASS_TO_PASS": [],
        "version": "1",
        "environment_setup_commit": "a" * 40,
        "created_at": "2020-01-01T00:00:00Z",
        "image": "/images/x",
        "test_cmd": "python3 -m pytest t.py",
    }
    return base | over


def test_records_validate_and_name_the_bad_field() -> None:
    r = validate_record(_record(FAIL_TO_PASS='["t.py::test_a"]', PASS_TO_PASS="[]"))
    assert r.FAIL_TO_PASS == ["t.py::test_a"] and r.data_source == "swebench" and r.workdir == "/testbed"
    assert r.log_parser == "parse_log_pytest"
    for field, value in [
        ("base_commit", "HEAD"),
        ("FAIL_TO_PASS", []),
        ("workdir", "testbed"),
        ("data_source", "x"),
    ]:
        with pytest.raises(RaasError) as e:
            validate_record(_record(**{field: value}))
        assert e.value.kind == "bad_request" and field in e.value.message
    missing = _record()
    del missing["test_cmd"]
    with pytest.raises(RaasError, match="test_cmd"):
        validate_record(missing)
    assert SweRecord.model_validate(_record(mutator="x")).model_dump()["mutator"] == "x"


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True, check=True).stdout


def test_patches_apply_and_the_repository_holds_one_commit_only(tmp_path: Path) -> None:
    base = tmp_path / "base"
    (base / "pkg").mkdir(parents=True)
    (base / "pkg/mod.py").write_text("def f(x):\n    return x - 1  # buggy\n")
    (base / "tests").mkdir()
    (base / "tests/test_other.py").write_text("def test_other():\n    pass\n")
    original = b"def f(x):\n    return x + 1  # ORIGINAL-LINE\n"
    hidden = {
        "tests/test_mod.py": b"from pkg.mod import f\n\ndef test_f():\n    assert f(1) == 2  # HIDDEN\n"
    }
    commit, patch, test_patch = repo.make_patches(
        base, {"pkg/mod.py": original}, hidden, tmp_path, 1600000000
    )
    assert "ORIGINAL-LINE" in patch and "tests/test_mod.py" not in patch
    assert "new file mode" in test_patch and "HIDDEN" in test_patch and "pkg/mod.py" not in test_patch

    testbed = tmp_path / "testbed"
    repo.copy_tree(base, testbed)
    assert repo.commit_tree(testbed, 1600000000) == commit  # reproducible
    assert _git(testbed, "rev-list", "--all").split() == [commit]
    assert _git(testbed, "status", "--porcelain") == ""
    objects = subprocess.run(
        ["git", "-C", str(testbed), "cat-file", "--batch-all-objects", "--batch"],
        capture_output=True,
        check=True,
    ).stdout.decode("utf-8", "replace")
    assert "buggy" in objects  # the check can see content...
    assert "ORIGINAL-LINE" not in objects and "HIDDEN" not in objects  # ...and the secrets are not there
    assert (
        "dangling"
        not in subprocess.run(
            ["git", "-C", str(testbed), "fsck", "--lost-found"], capture_output=True, text=True, check=True
        ).stdout
    )

    (testbed / "gold.patch").write_text(patch)
    (testbed / "test.patch").write_text(test_patch)
    _git(testbed, "apply", "--verbose", "gold.patch")
    _git(testbed, "apply", "--verbose", "test.patch")
    assert (testbed / "pkg/mod.py").read_bytes() == original
    assert (testbed / "tests/test_mod.py").read_bytes() == hidden["tests/test_mod.py"]
    # build artefacts of a test run do not dirty the tree
    (testbed / "pkg/__pycache__").mkdir()
    (testbed / "pkg/__pycache__/mod.cpython-311.pyc").write_bytes(b"x")
    assert "__pycache__" not in _git(testbed, "status", "--porcelain")


def test_builder_refuses_bad_options(tmp_path: Path) -> None:
    from raas.sandbox import SandboxManager
    from raas.tasks.swe.build import Builder, BuildOptions

    manager = SandboxManager(tmp_path / "state")
    for opts in (
        BuildOptions(packages=["six"], per_package=0),
        BuildOptions(packages=["six"], mutators=["rename_everything"]),
        BuildOptions(packages=["nope"]),
    ):
        with pytest.raises(RaasError) as e:
            Builder(opts, manager)
        assert e.value.kind == "bad_request"


def test_sdist_time_never_gives_git_a_1970_date(tmp_path: Path) -> None:
    import io
    import tarfile

    from raas.tasks.swe.packages import EARLIEST_TIME, sdist_time

    def sdist(times: dict[str, int]) -> Path:
        path = tmp_path / f"p-{len(list(tmp_path.iterdir()))}.tar.gz"
        with tarfile.open(path, "w:gz") as tar:
            for name, mtime in times.items():
                info = tarfile.TarInfo(name)
                info.size, info.mtime = 1, mtime
                tar.addfile(info, io.BytesIO(b"x"))
        return path

    assert sdist_time(sdist({"p-1/PKG-INFO": 1600000000, "p-1/a.py": 1700000000})) == 1600000000
    assert sdist_time(sdist({"p-1/PKG-INFO": 0, "p-1/a.py": 1700000000})) == 1700000000  # flit, epoch 0
    assert sdist_time(sdist({"p-1/PKG-INFO": 0})) == EARLIEST_TIME
