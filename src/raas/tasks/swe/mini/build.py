"""Building the ``swe-mini`` curriculum: SWE-bench-format records from the corpus, with raas's own builder.

The rungs (``level``), easiest first:

* ``function``: a repository of one module holding one function, and the issue names the function, the
  file, the failing calls, what they return and what they should return;
* ``module``: the function's whole module (3-4 functions), the same kind of issue;
* ``report``: the whole module, and an issue written from the failing tests only
  (:func:`raas.tasks.swe.problem.write_problem_statement`: it never names the file or the function).

The real-package instances of ``raas swe build`` are the rung above (``--packages``, :mod:`.cli`).

Each candidate bug is a single-site mutation of the target function (:mod:`raas.tasks.swe.mutate`), run
against the repository's tests (one file per function, ``assert CALL == EXPECTED`` per case) in a fresh
networkless sandbox. It is kept as SWE-bench's builder keeps one (:func:`raas.tasks.swe.build.judge`):
some of the function's tests now fail and every other test passes; the failing tests' file is hidden
(``test_patch``), the gold patch restores the function, and the instance's own image is then checked
through the grading loop (fails before, resolved with the gold patch). Records are cached by everything
that defines them, so a second build is instant.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import shlex
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from raas.errors import RaasError
from raas.sandbox import SandboxManager
from raas.sandbox.client import tar_directory
from raas.sandbox.images import image_cache_dir
from raas.tasks.swe import envimage, grading, problem, repo
from raas.tasks.swe.build import LOG_PARSER, Verdict, judge, pytest_command, safe_test_ids
from raas.tasks.swe.mutate import Mutation, candidate_mutations
from raas.tasks.swe.packages import PackageSpec
from raas.tasks.swe.records import SweRecord
from raas.tasks.swe.runner import CommandRun, SuiteSandboxes

from .corpus import Function, Module, load_corpus

BUILD_VERSION = 1
Level = Literal["function", "module", "report"]
LEVELS: tuple[Level, ...] = ("function", "module", "report")
MUTATORS = ("flip_comparison", "off_by_one", "swap_operands", "change_operator", "wrong_constant")
"""Bugs fixed by changing one expression (an if-statement removal needs code written anew)."""
TIMESTAMP = 1767225600  # 2026-01-01: every commit of the curriculum is dated the same
SPEC = PackageSpec(
    name="swe-mini",
    version="1",
    sha256="",
    modules=(),
    sources=("",),
    tests=("tests",),
    style="generated: one pytest file per function, one assert per test",
)
"""The test environment (pytest, pinned) the curriculum's images share with the real packages'."""
PROBE = "/tmp/raas-mini-probe.py"
PROBE_OUT = "/tmp/raas-mini-probe.json"
PROBE_SOURCE = """\
import importlib, json, sys
sys.path.insert(0, "/testbed")
mod = importlib.import_module(sys.argv[1])
out = []
for call, expected in json.loads(sys.argv[2]):
    row = []
    for text in (call, expected):
        try:
            row.append(repr(eval(text, dict(vars(mod)))))
        except Exception as e:
            row.append("raises %s: %s" % (type(e).__name__, e))
    out.append(row)
with open(sys.argv[3], "w") as f:
    json.dump(out, f)
"""
SUITE_TIMEOUT_S = 10.0
"""A module's tests run in well under a second; a bug that makes them loop is rejected after this."""
MAX_SHOWN_CALLS = 2
MAX_REPR = 80


@dataclass(frozen=True)
class Target:
    """One function to put a bug in, inside a repository of one level."""

    level: Level
    module: Module
    function: Function

    @property
    def file(self) -> str:
        return f"{self.function.name if self.level == 'function' else self.module.name}.py"

    @property
    def import_name(self) -> str:
        return self.file.removesuffix(".py")

    def files(self) -> dict[str, str]:
        """The repository: the module and one test file per function."""
        functions = (self.function,) if self.level == "function" else self.module.functions
        source = self.module.standalone(self.function) if self.level == "function" else self.module.source
        out = {self.file: source}
        for fn in functions:
            out[cases_module_path(fn)] = cases_module_text(self.import_name, fn)
        return out


def cases_module_path(fn: Function) -> str:
    return f"tests/test_{fn.name}.py"


def cases_module_text(import_name: str, fn: Function) -> str:
    """One test per case: ``assert CALL == EXPECTED``."""
    body = [f"from {import_name} import {fn.name}", ""]
    for i, case in enumerate(fn.cases, 1):
        body += ["", f"def test_{fn.name}_{i}():", f"    assert {case.call} == {case.expected}", ""]
    return "\n".join(body)


def _short(text: str) -> str:
    return text if len(text) <= MAX_REPR else text[: MAX_REPR - 3] + "..."


def named_statement(target: Target, failing: list[tuple[str, str, str]]) -> str:
    """The issue of the ``function`` and ``module`` rungs: names the function, the file and up to two
    failing calls with what they give and what they should give (``failing``: call, got, expected)."""
    lines = [f"Bug in `{target.function.name}` (file `{target.file}`):"]
    for call, got, want in failing[:MAX_SHOWN_CALLS]:
        verb = got if got.startswith("raises ") else f"returns {_short(got)}"
        lines.append(f"`{call}` {verb}, expected {_short(want)}.")
    return "\n".join(lines) + "\n"


@dataclass
class MiniOptions:
    levels: tuple[Level, ...] = LEVELS
    per_target: int = 1
    """Instances per (level, function)."""
    tries_per_target: int = 6
    """Candidate bugs tried per (level, function) before giving up on it."""
    seed: int = 0
    jobs: int = 2
    backend: str = "bwrap"
    mutators: tuple[str, ...] = MUTATORS
    modules: tuple[str, ...] | None = None
    """Only these corpus modules (None: all)."""
    corpus_dir: str | None = None
    cache: Path | None = None
    use_cache: bool = True


@dataclass
class MiniReport:
    targets: int = 0
    tried: int = 0
    accepted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    by_level: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    cached: bool = False


ProgressFn = Callable[[MiniReport], None]


def _order(candidates: list[Mutation], key: str) -> list[Mutation]:
    out = sorted(candidates, key=lambda m: m.key)
    random.Random(key).shuffle(out)
    return out


class MiniBuilder:
    """See the module docstring."""

    def __init__(
        self, opts: MiniOptions, manager: SandboxManager, progress: ProgressFn | None = None
    ) -> None:
        unknown = [lv for lv in opts.levels if lv not in LEVELS]
        if unknown or not opts.levels:
            raise RaasError(f"levels must be among {LEVELS}, got {list(opts.levels)}", kind="bad_request")
        if opts.per_target < 1 or opts.tries_per_target < 1:
            raise RaasError("per_target and tries_per_target must be >= 1", kind="bad_request")
        self.opts = opts
        modules = load_corpus(opts.corpus_dir)
        if opts.modules is not None:
            missing = set(opts.modules) - {m.name for m in modules}
            if missing:
                raise RaasError(f"no corpus module {sorted(missing)}", kind="bad_request")
            modules = tuple(m for m in modules if m.name in opts.modules)
        self.modules = modules
        self.cache = opts.cache or image_cache_dir()
        self.sandboxes = SuiteSandboxes(manager, opts.backend, opts.jobs, SUITE_TIMEOUT_S)
        self.progress = progress or (lambda report: None)
        self.report = MiniReport()
        self._env: Path | None = None
        self._baselines: dict[str, asyncio.Future[tuple[dict[str, str], set[str]]]] = {}

    def targets(self) -> list[Target]:
        return [Target(level, m, f) for level in self.opts.levels for m in self.modules for f in m.functions]

    def result_key(self) -> str:
        blob = json.dumps(
            [
                BUILD_VERSION,
                [(m.name, m.split, m.source, [asdict(f) for f in m.functions]) for m in self.modules],
                {
                    k: v
                    for k, v in asdict(self.opts).items()
                    if k in ("levels", "per_target", "tries_per_target", "seed", "mutators")
                },
            ],
            sort_keys=True,
            default=str,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def result_path(self) -> Path:
        return self.cache / "swe-builds" / f"swe-mini-{self.result_key()}.json"

    def cached(self) -> list[SweRecord] | None:
        path = self.result_path()
        if not self.opts.use_cache or not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            records = [SweRecord.model_validate(r) for r in data["records"]]
            report = MiniReport(**data["report"])
        except (OSError, ValueError, TypeError, KeyError):
            return None
        if not all(Path(r.image, "testbed/.git").is_dir() for r in records):
            return None
        self.report = report
        self.report.cached = True
        return records

    async def build(self) -> list[SweRecord]:
        records = self.cached()
        if records is not None:
            self.progress(self.report)
            return records
        started = time.monotonic()
        self._env = await asyncio.to_thread(envimage.build_env_image, SPEC, cache=self.cache)
        targets = self.targets()
        self.report.targets = len(targets)
        self.progress(self.report)
        work = Path(tempfile.mkdtemp(prefix="raas-swe-mini-"))
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._target(t, work)) for t in targets]
        finally:
            shutil.rmtree(work, ignore_errors=True)
        records = [r for t in tasks for r in t.result()]
        self.report.seconds = round(time.monotonic() - started, 1)
        path = self.result_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".part")
        tmp.write_text(
            json.dumps(
                {"records": [r.model_dump(mode="json") for r in records], "report": asdict(self.report)}
            )
        )
        tmp.replace(path)
        self.progress(self.report)
        return records

    # -- one target ------------------------------------------------------------------------------------

    async def _target(self, target: Target, work: Path) -> list[SweRecord]:
        files = target.files()
        root = work / f"{target.level}-{target.module.name}-{target.function.name}"
        await asyncio.to_thread(_write_tree, root, files)
        tar = await asyncio.to_thread(tar_directory, root)
        suite = pytest_command(SPEC, ["tests"])
        baseline, safe = await self._baseline(target, tar, suite)
        assert self._env is not None
        source = files[target.file]
        candidates = [
            m
            for m in candidate_mutations(source, target.file, list(self.opts.mutators))
            if m.function == target.function.name
        ]
        ordered = _order(candidates, f"{self.opts.seed}:{target.level}:{target.function.name}")
        cases = [[c.call, c.expected] for c in target.function.cases]
        probe = {PROBE: PROBE_SOURCE.encode()}
        command = (
            f"{suite}; rc=$?; timeout 5 python3 -B {PROBE} {target.import_name} "
            f"{shlex.quote(json.dumps(cases))} {PROBE_OUT}; exit $rc"
        )
        out: list[SweRecord] = []
        for m in ordered[: self.opts.tries_per_target]:
            if len(out) >= self.opts.per_target:
                break
            if not await asyncio.to_thread(m.verify):
                self._reject("not_exact")
                continue
            run, raw = await self.sandboxes.run(
                self._env,
                tar,
                {**probe, f"/testbed/{target.file}": m.mutated.encode()},
                command,
                60.0,
                PROBE_OUT,
            )
            self.report.tried += 1
            status = grading.parse_test_output(run.output, LOG_PARSER)
            verdict = judge(baseline, status, safe, run, max_failing=len(target.function.cases))
            if verdict.reason != "accepted":
                self._reject(verdict.reason)
                continue
            record = await self._instance(target, m, verdict, run, raw, root, work)
            if record is None:
                self._reject("verification_failed")
                continue
            out.append(record)
            self.report.accepted += 1
            self.report.by_level[target.level] = self.report.by_level.get(target.level, 0) + 1
            self.progress(self.report)
        return out

    async def _baseline(self, target: Target, tar: bytes, suite: str) -> tuple[dict[str, str], set[str]]:
        """The tests' statuses on the correct code and the ids the parser reads back exactly, run once per
        repository (the ``module`` and ``report`` rungs share theirs) and checked: every test passes."""
        key = hashlib.sha256(tar).hexdigest()
        if key not in self._baselines:
            self._baselines[key] = asyncio.ensure_future(self._run_baseline(target, tar, suite))
        return await self._baselines[key]

    async def _run_baseline(self, target: Target, tar: bytes, suite: str) -> tuple[dict[str, str], set[str]]:
        assert self._env is not None
        base, _ = await self.sandboxes.run(self._env, tar, {}, suite, SUITE_TIMEOUT_S)
        baseline = grading.parse_test_output(base.output, LOG_PARSER)
        if base.exit_code != 0 or not baseline or any(s != "PASSED" for s in baseline.values()):
            raise RaasError(
                f"swe-mini: the tests of {target.module.name}.{target.function.name} do not pass on the "
                f"correct code: {base.output[-1500:]}",
                kind="internal",
            )
        return baseline, safe_test_ids(base.output)

    def _reject(self, reason: str) -> None:
        self.report.rejected[reason] = self.report.rejected.get(reason, 0) + 1
        self.progress(self.report)

    async def _instance(
        self,
        target: Target,
        m: Mutation,
        verdict: Verdict,
        run: CommandRun,
        probe_raw: bytes | None,
        root: Path,
        work: Path,
    ) -> SweRecord | None:
        failing = _failing_calls(target, probe_raw)
        if target.level != "report" and not failing:
            return None  # the tests fail but no call shows it (e.g. a crash at import): no issue to write
        statement = (
            named_statement(target, failing)
            if target.level != "report"
            else _report_statement(target, m, verdict.fail_to_pass, run.output)
        )
        assert self._env is not None
        record = await asyncio.to_thread(
            _prepare, target, m, verdict.fail_to_pass, statement, root, work, self._env
        )
        if not await self.sandboxes.verify(record):
            await asyncio.to_thread(envimage.remove_image, Path(record.image))
            return None
        return record


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def _failing_calls(target: Target, raw: bytes | None) -> list[tuple[str, str, str]]:
    """(call, what it gives, what it should give) for each case the bug breaks, from the probe's output."""
    if raw is None:
        return []
    try:
        rows = json.loads(raw)
    except ValueError:
        return []
    out = []
    for case, row in zip(target.function.cases, rows, strict=False):
        if not (isinstance(row, list) and len(row) == 2):
            return []
        got, want = str(row[0]), str(row[1])
        if got != want:
            out.append((case.call, got, want))
    return out


def _report_statement(target: Target, m: Mutation, failing: list[str], log: str) -> str:
    test_files = {cases_module_path(f) for f in target.module.functions}
    secrets = problem.secrets_for(target.file, m.functions, [target.import_name])
    return problem.write_problem_statement(
        target.module.name, failing, log, test_files, secrets, seed=f"{target.module.name}-{m.key}"
    )


def _prepare(
    target: Target, m: Mutation, f2p: list[str], statement: str, root: Path, work: Path, env: Path
) -> SweRecord:
    """The record and image of an accepted bug (blocking: files, git, the image copy)."""
    hidden = sorted({t.split("::", 1)[0] for t in f2p})
    inst = work / f"inst-{target.level}-{m.key}"
    base_tree = inst / "base"
    repo.copy_tree(root, base_tree, skip=set(hidden))
    (base_tree / target.file).write_text(m.mutated, encoding="utf-8")
    hidden_files = {rel: (root / rel).read_bytes() for rel in hidden}
    fixed = {target.file: m.original.encode("utf-8")}
    base_commit, patch, test_patch = repo.make_patches(base_tree, fixed, hidden_files, inst, TIMESTAMP)
    testbed = inst / "testbed"
    repo.copy_tree(base_tree, testbed)
    if repo.commit_tree(testbed, TIMESTAMP) != base_commit:
        raise RaasError("the repository commit is not reproducible", kind="internal")
    instance_id = f"swe-mini__{target.level}-{target.module.name}-{target.function.name}-{m.key}"
    image = envimage.build_instance_image(env, testbed, instance_id, base_commit)
    every = [
        f"{cases_module_path(fn)}::test_{fn.name}_{i}"
        for fn in ((target.function,) if target.level == "function" else target.module.functions)
        for i in range(1, len(fn.cases) + 1)
    ]
    shutil.rmtree(inst, ignore_errors=True)
    return SweRecord(
        instance_id=instance_id,
        repo=f"swe-mini/{target.module.name}",
        base_commit=base_commit,
        problem_statement=statement,
        patch=patch,
        test_patch=test_patch,
        FAIL_TO_PASS=f2p,
        PASS_TO_PASS=[t for t in every if t not in f2p],
        version="1",
        environment_setup_commit=base_commit,
        created_at=datetime.fromtimestamp(TIMESTAMP, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        data_source="swe-mini",
        image=str(image),
        test_cmd=pytest_command(SPEC, ["tests"]),
        log_parser=LOG_PARSER,
        mutator=m.mutator,
        hidden_tests=hidden,
        level=target.level,
        split=target.module.split,
        module=target.module.name,
        function=target.function.name,
    )


async def build_mini(
    opts: MiniOptions, progress: ProgressFn | None = None
) -> tuple[list[SweRecord], MiniReport]:
    """Build (or read from the cache) the curriculum, with a sandbox manager of its own."""
    state = Path(tempfile.mkdtemp(prefix="raas-swe-mini-build-"))
    manager = SandboxManager(state / "state")
    try:
        builder = MiniBuilder(opts, manager, progress)
        records = await builder.build()
        return records, builder.report
    finally:
        await manager.close_all()
        shutil.rmtree(state, ignore_errors=True)


def split_records(
    records: list[SweRecord], split: str, levels: tuple[str, ...] | None = None
) -> list[dict[str, Any]]:
    """The records of one split (and ``levels``, default all) as instances (JSON-ready dicts), the levels
    taken in turn, each in a fixed pseudo-random order: any prefix is a mix of the rungs."""
    by_level: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        row = r.model_dump(mode="json")
        if row.get("split") == split and (levels is None or row.get("level") in levels):
            by_level.setdefault(str(row["level"]), []).append(row)
    queues = [
        sorted(rows, key=lambda r: hashlib.sha256(r["instance_id"].encode()).hexdigest())
        for _, rows in sorted(by_level.items(), key=lambda kv: LEVELS.index(kv[0]))
    ]
    out: list[dict[str, Any]] = []
    while any(queues):
        for q in queues:
            if q:
                out.append(q.pop(0))
    return out
