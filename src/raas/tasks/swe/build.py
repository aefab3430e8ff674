"""`raas swe build`: SWE-style instances from real packages, their own test suites and injected bugs.

Per package: fetch the pinned sdist, build its environment image, run its suite once in a sandbox (the
baseline), then try single-site bugs (:mod:`.mutate`) one function at a time, each against the whole
suite in a fresh networkless sandbox. A bug is kept only if 1..``max_failing`` tests that passed before
now fail and every other test still passes. Its FAIL_TO_PASS tests' files are hidden from the repository
and come back in ``test_patch``; the gold ``patch`` restores the function. Every kept instance gets its own
image and is then checked through the same loop a grader uses (:func:`.runner.evaluate`): at
``base_commit`` the tests fail, with the gold patch they pass; one that does not is dropped.

Package results are cached (keyed by everything that defines them), so a second build is instant.
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
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from raas.errors import RaasError
from raas.sandbox import SandboxManager
from raas.sandbox.client import tar_directory
from raas.sandbox.images import image_cache_dir

from . import coverage, envimage, grading, problem, repo
from .mutate import MUTATORS, Mutation, candidate_mutations
from .packages import PackageSpec, fetch_sdist, get_package, sdist_time, unpack_sdist
from .records import SweRecord
from .runner import CommandRun, SuiteSandboxes

BUILD_VERSION = 3  # bump when what a build produces changes (invalidates cached package results)
LOG_PARSER = "parse_log_pytest"
_STATUS_LINE = ("PASSED", "FAILED", "SKIPPED", "ERROR", "XFAIL", "XPASS")


def pytest_command(spec: PackageSpec, paths: Sequence[str]) -> str:
    """The test command: bytecode and cache writes off (the tree stays clean), every outcome listed
    (``-rA``, which SWE-bench's pytest parser reads), node ids relative to /testbed."""
    args = ["python3", "-B", "-m", "pytest", "-rA", "--tb=short", "-p", "no:cacheprovider"]
    args += ["--rootdir=/testbed", *spec.pytest_args, *paths]
    return " ".join(shlex.quote(a) for a in args)


def safe_test_ids(log: str) -> set[str]:
    """Test ids the SWE-bench pytest parser reads back exactly: reported once, without whitespace
    (the parser splits on it, so ``test_x[a b]`` would become ``test_x[a``)."""
    seen: Counter[str] = Counter()
    unsafe: set[str] = set()
    for line in log.splitlines():
        status, _, rest = line.partition(" ")
        if status not in _STATUS_LINE or not rest:
            continue
        if status == "FAILED" and " - " in rest:
            rest = rest.split(" - ", 1)[0]
        ident = rest.strip()
        key = ident.split()[0]
        seen[key] += 1
        if ident != key:
            unsafe.add(key)
    return {k for k, n in seen.items() if n == 1 and k not in unsafe}


@dataclass
class Verdict:
    """What one candidate bug did to the suite."""

    reason: str  # "accepted" or why not
    fail_to_pass: list[str] = field(default_factory=list)


def judge(
    baseline: dict[str, str], mutated: dict[str, str], safe: set[str], run: CommandRun, max_failing: int
) -> Verdict:
    """Keep a bug only if 1..max_failing passing tests now fail (FAILED/ERROR, each reported exactly)
    and every other passing test still passes."""
    if run.timed_out:
        return Verdict("timeout")
    if run.exit_code not in (0, 1):
        return Verdict(f"pytest_exit_{run.exit_code}")
    passing = [t for t, s in baseline.items() if s == "PASSED"]
    broken = [t for t in passing if mutated.get(t) != "PASSED"]
    if not broken:
        return Verdict("no_failure")
    if any(t not in mutated for t in broken):
        return Verdict("tests_missing")  # a collection error or a crash took tests with it
    if len(broken) > max_failing:
        return Verdict("too_many_failures")
    if any(mutated[t] not in ("FAILED", "ERROR") for t in broken):
        return Verdict("not_a_failure")  # e.g. now skipped
    if any(t not in safe for t in broken):
        return Verdict("unparseable_test_id")
    return Verdict("accepted", sorted(broken))


def order_candidates(mutations: list[Mutation], seed: int) -> list[Mutation]:
    """Deterministic order mixing kinds: each mutator's sites shuffled, then taken round-robin."""
    rng = random.Random(seed)
    groups: dict[str, list[Mutation]] = {}
    for m in mutations:
        groups.setdefault(m.mutator, []).append(m)
    names = sorted(groups)
    rng.shuffle(names)
    for n in names:
        random.Random(f"{seed}:{n}").shuffle(groups[n])
    out: list[Mutation] = []
    while any(groups.values()):
        for n in names:
            if groups[n]:
                out.append(groups[n].pop())
    return out


def all_mutations(spec: PackageSpec, root: Path, mutators: Sequence[str]) -> list[Mutation]:
    """Every candidate bug in the package's source files (sorted by file), not yet verified."""
    out: list[Mutation] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if spec.is_source(rel):
            out += candidate_mutations(path.read_text(encoding="utf-8"), rel, list(mutators))
    return out


@dataclass
class Accepted:
    """A bug that passed :func:`judge`, with the runs that decided it."""

    fail_to_pass: list[str]
    baseline: dict[str, str]  # status map before
    status: dict[str, str]  # status map with the bug
    safe: set[str]  # ids the parser reads back exactly
    log: str  # the suite's output with the bug (the problem statement is written from it)
    timestamp: int  # the commit date


def prepare_instance(
    spec: PackageSpec, root: Path, env: Path, m: Mutation, acc: Accepted, work: Path
) -> SweRecord:
    """The record and image of an accepted bug: the buggy tree without the hidden test files committed
    once, the gold and test patches, the problem statement. Blocking (files, git, image copy)."""
    f2p = acc.fail_to_pass
    hidden = sorted({t.split("::", 1)[0] for t in f2p})
    p2p = sorted(
        t
        for t, s in acc.baseline.items()
        if s == "PASSED"
        and t in acc.safe
        and t not in f2p
        and t.split("::", 1)[0] in hidden
        and acc.status.get(t) == "PASSED"
    )
    inst = work / f"inst-{m.key}"
    base_tree = inst / "base"
    repo.copy_tree(root, base_tree, skip=set(hidden))
    (base_tree / m.file).write_text(m.mutated, encoding="utf-8")
    hidden_files = {rel: (root / rel).read_bytes() for rel in hidden}
    fixed = {m.file: m.original.encode("utf-8")}
    base_commit, patch, test_patch = repo.make_patches(base_tree, fixed, hidden_files, inst, acc.timestamp)
    testbed = inst / "testbed"
    repo.copy_tree(base_tree, testbed)
    if repo.commit_tree(testbed, acc.timestamp) != base_commit:
        raise RaasError("the repository commit is not reproducible", kind="internal")
    instance_id = f"pypi__{spec.name}-{spec.version}-{m.key}"
    image = envimage.build_instance_image(env, testbed, instance_id, base_commit)
    test_files = {
        rel for rel in (p.relative_to(root).as_posix() for p in root.rglob("*.py")) if spec.is_test(rel)
    }
    secrets = problem.secrets_for(m.file, m.functions, spec.modules)
    statement = problem.write_problem_statement(
        spec.name, f2p, acc.log, test_files | set(hidden), secrets, seed=instance_id
    )
    shutil.rmtree(inst, ignore_errors=True)
    return SweRecord(
        instance_id=instance_id,
        repo=f"pypi/{spec.name}",
        base_commit=base_commit,
        problem_statement=statement,
        patch=patch,
        test_patch=test_patch,
        FAIL_TO_PASS=f2p,
        PASS_TO_PASS=p2p,
        version=spec.version,
        environment_setup_commit=base_commit,
        created_at=datetime.fromtimestamp(acc.timestamp, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        image=str(image),
        test_cmd=pytest_command(spec, hidden),
        log_parser=LOG_PARSER,
        mutator=m.mutator,
        hidden_tests=hidden,
    )


@dataclass
class BuildOptions:
    packages: Sequence[str]
    per_package: int = 3
    seed: int = 0
    jobs: int = 2
    backend: str = "bwrap"
    max_failing: int = 20
    max_candidates: int | None = None  # per package; default 15 x per_package
    suite_timeout_s: float = 600.0
    cache: Path | None = None
    mutators: Sequence[str] = tuple(MUTATORS)
    use_cache: bool = True


@dataclass
class PackageReport:
    package: str
    version: str
    tests: int = 0
    baseline_s: float = 0.0
    candidates: int = 0
    tried: int = 0
    accepted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    cached: bool = False


ProgressFn = Callable[[str, str, PackageReport], None]


class Builder:
    """Builds instances for several packages with a bounded number of sandbox runs at once."""

    def __init__(self, opts: BuildOptions, manager: SandboxManager, progress: ProgressFn | None = None):
        if opts.per_package < 1:
            raise RaasError("per_package must be at least 1", kind="bad_request")
        unknown = [m for m in opts.mutators if m not in MUTATORS]
        if unknown:
            raise RaasError(f"unknown mutators {unknown}; known: {sorted(MUTATORS)}", kind="bad_request")
        self.opts = opts
        self.specs = [get_package(p) for p in opts.packages]
        self.manager = manager
        self.cache = opts.cache or image_cache_dir()
        self.progress = progress or (lambda package, event, report: None)
        self.sandboxes = SuiteSandboxes(manager, opts.backend, opts.jobs, opts.suite_timeout_s)

    async def build(self) -> tuple[list[SweRecord], list[PackageReport]]:
        """All packages at once (their sandbox runs share the ``jobs`` slots); the first package that
        fails stops the others and its error is raised."""
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(self._package(s)) for s in self.specs]
        except* RaasError as group:
            raise group.exceptions[0] from None
        results = [t.result() for t in tasks]
        records = [r for recs, _ in results for r in recs]
        return records, [rep for _, rep in results]

    # ---- per package -------------------------------------------------------------------------------
    def _result_key(self, spec: PackageSpec, env: Path) -> str:
        blob = json.dumps(
            [
                BUILD_VERSION,
                asdict(spec),
                env.name,
                self.opts.per_package,
                self.opts.seed,
                self.opts.max_failing,
                self.opts.max_candidates,
                sorted(self.opts.mutators),
            ],
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def _cached(self, path: Path) -> tuple[list[SweRecord], PackageReport] | None:
        if not self.opts.use_cache or not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            records = [SweRecord.model_validate(r) for r in data["records"]]
            report = PackageReport(**data["report"])
        except (OSError, ValueError, TypeError, KeyError):
            return None
        if not all(Path(r.image, "testbed/.git").is_dir() for r in records):
            return None
        report.cached = True
        return records, report

    async def _run(
        self,
        image: Path,
        tar: bytes,
        files: dict[str, bytes],
        command: str,
        timeout_s: float,
        fetch: str | None = None,
    ) -> tuple[CommandRun, bytes | None]:
        return await self.sandboxes.run(image, tar, files, command, timeout_s, fetch)

    async def _coverage(
        self, spec: PackageSpec, env: Path, tar: bytes, sources: list[str], suite: str, timeout_s: float
    ) -> coverage.LineCoverage | None:
        """Per-line test counts from one traced run of the suite (None if that run failed)."""
        plugin = {f"{coverage.PLUGIN_DIR}/{coverage.PLUGIN_MODULE}.py": coverage.PLUGIN_SOURCE.encode()}
        files = ":".join(f"/testbed/{rel}" for rel in sources)
        command = (
            f"env PYTHONPATH={coverage.PLUGIN_DIR} {coverage.ENV_FILES}={shlex.quote(files)} "
            f"{suite} -p {coverage.PLUGIN_MODULE}"
        )
        run, data = await self._run(env, tar, plugin, command, timeout_s, fetch=coverage.OUTPUT)
        if run.timed_out or data is None:
            return None
        try:
            return coverage.LineCoverage.parse(data.decode())
        except (ValueError, TypeError):
            return None

    async def _package(self, spec: PackageSpec) -> tuple[list[SweRecord], PackageReport]:
        t0 = time.monotonic()
        report = PackageReport(spec.name, spec.version)
        self.progress(spec.name, "fetch", report)
        sdist = await asyncio.to_thread(fetch_sdist, spec, self.cache / "swe-sdists")
        env = await asyncio.to_thread(envimage.build_env_image, spec, cache=self.cache)
        result_file = self.cache / "swe-builds" / f"{spec.name}-{self._result_key(spec, env)}.json"
        cached = self._cached(result_file)
        if cached is not None:
            self.progress(spec.name, "cached", cached[1])
            return cached
        work = Path(tempfile.mkdtemp(prefix=f"raas-swe-{spec.name}-"))
        try:
            records = await self._package_in(spec, sdist, env, work, report)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        report.seconds = round(time.monotonic() - t0, 1)
        result_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = result_file.with_suffix(".part")
        tmp.write_text(
            json.dumps({"records": [r.model_dump(mode="json") for r in records], "report": asdict(report)})
        )
        tmp.replace(result_file)
        self.progress(spec.name, "done", report)
        return records, report

    async def _package_in(
        self, spec: PackageSpec, sdist: Path, env: Path, work: Path, report: PackageReport
    ) -> list[SweRecord]:
        opts = self.opts
        root = await asyncio.to_thread(unpack_sdist, sdist, work / "src")
        timestamp = sdist_time(sdist)
        tar = await asyncio.to_thread(tar_directory, root)
        self.progress(spec.name, "baseline", report)
        suite = pytest_command(spec, spec.tests)
        base_run, _ = await self._run(env, tar, {}, suite, opts.suite_timeout_s)
        baseline = grading.parse_test_output(base_run.output, LOG_PARSER)
        passing = {t for t, s in baseline.items() if s == "PASSED"}
        if base_run.timed_out or base_run.exit_code not in (0, 1) or not passing:
            raise RaasError(
                f"{spec.name}'s test suite does not run in its image (exit {base_run.exit_code}, "
                f"timed out {base_run.timed_out}): {base_run.output[-2000:]}",
                kind="internal",
            )
        safe = safe_test_ids(base_run.output)
        report.tests, report.baseline_s = len(passing), round(base_run.seconds, 2)
        timeout = min(opts.suite_timeout_s, max(30.0, 6 * base_run.seconds))  # loops forever: rejected

        mutations = await asyncio.to_thread(all_mutations, spec, root, opts.mutators)
        candidates = order_candidates(mutations, opts.seed)
        sources = sorted({m.file for m in mutations})
        self.progress(spec.name, "coverage", report)
        cov = await self._coverage(spec, env, tar, sources, suite, timeout)
        if cov is not None:
            candidates = coverage.prioritize(candidates, cov, opts.max_failing)
        report.candidates = len(candidates)
        budget = opts.max_candidates or 15 * opts.per_package
        used_functions: set[tuple[str, str]] = set()
        records: list[SweRecord] = []
        rejected: Counter[str] = Counter()
        index = 0
        self.progress(spec.name, "mutate", report)
        while len(records) < opts.per_package and index < len(candidates) and report.tried < budget:
            window: list[Mutation] = []
            while index < len(candidates) and len(window) < max(1, opts.jobs):
                m = candidates[index]
                index += 1
                if (m.file, m.function) in used_functions or any(
                    (w.file, w.function) == (m.file, m.function) for w in window
                ):
                    continue
                if not await asyncio.to_thread(m.verify):
                    rejected["not_exact"] += 1
                    continue
                window.append(m)
            runs = await asyncio.gather(
                *(
                    self._run(env, tar, {f"/testbed/{m.file}": m.mutated.encode()}, suite, timeout)
                    for m in window
                )
            )
            for m, (run, _) in zip(window, runs, strict=True):
                report.tried += 1
                if len(records) >= opts.per_package or (m.file, m.function) in used_functions:
                    continue
                status = grading.parse_test_output(run.output, LOG_PARSER)
                verdict = judge(baseline, status, safe, run, opts.max_failing)
                if verdict.reason == "accepted":
                    accepted = Accepted(verdict.fail_to_pass, baseline, status, safe, run.output, timestamp)
                    record = await self._assemble(spec, root, env, m, accepted, work)
                    if record is None:
                        verdict.reason = "verification_failed"
                    else:
                        records.append(record)
                        used_functions.add((m.file, m.function))
                if verdict.reason != "accepted":
                    rejected[verdict.reason] += 1
                report.accepted, report.rejected = len(records), dict(rejected)
                self.progress(spec.name, "candidate", report)
        return records

    async def _assemble(
        self, spec: PackageSpec, root: Path, env: Path, m: Mutation, accepted: Accepted, work: Path
    ) -> SweRecord | None:
        """Turn an accepted bug into a record and an image, and check both; None if the check fails."""
        record = await asyncio.to_thread(prepare_instance, spec, root, env, m, accepted, work)
        if not await self._verify(record):
            await asyncio.to_thread(envimage.remove_image, Path(record.image))
            return None
        return record

    async def _verify(self, record: SweRecord) -> bool:
        return await self.sandboxes.verify(record)


async def build(
    opts: BuildOptions, progress: ProgressFn | None = None
) -> tuple[list[SweRecord], list[PackageReport]]:
    """Build the instances with a sandbox manager of its own (every sandbox closed on return)."""
    state = Path(tempfile.mkdtemp(prefix="raas-swe-build-"))
    manager = SandboxManager(state / "state")
    try:
        return await Builder(opts, manager, progress).build()
    finally:
        await manager.close_all()
        shutil.rmtree(state, ignore_errors=True)
