"""The real open-source packages SWE-style tasks are built from, pinned, and how to fetch them.

Each package is a pure-Python PyPI project whose sdist ships its own test suite, chosen for a suite that
runs offline in seconds (so a build can run every candidate bug against it). The sdist is fetched at
build time with ``pip download --no-deps --no-binary :all: NAME==VERSION`` and checked against the pinned
SHA-256, so a build is reproducible and a swapped upload is refused.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from raas.errors import RaasError

# The test runner every environment image gets, pinned with its whole dependency closure (installed with
# --no-deps, so the image is the same on every build). pytest 8 reports a failing unittest ``subTest`` as
# a failure of its test, which is what the SWE-bench log parser expects.
TEST_DEPS: tuple[str, ...] = (
    "pytest==8.4.2",
    "pluggy==1.7.0",
    "iniconfig==2.3.1",
    "packaging==26.4",
    "pygments==2.21.0",
)


@dataclass(frozen=True)
class PackageSpec:
    """One source package: where its code and tests are, and how its suite runs."""

    name: str  # the PyPI project name
    version: str
    sha256: str  # of the sdist
    modules: tuple[str, ...]  # top-level import names (must not come in through the test deps)
    sources: tuple[str, ...]  # files/dirs (relative to the sdist root) whose functions may be mutated
    tests: tuple[str, ...]  # files/dirs passed to pytest for the whole suite
    style: str  # the test style, for docs and reports
    pythonpath: str = ""  # directory below the repo root to import the package from ("src" layouts)
    exclude: tuple[str, ...] = ()  # path prefixes never mutated (data tables, tests inside the package)
    test_deps: tuple[str, ...] = TEST_DEPS
    pytest_args: tuple[str, ...] = field(default=())

    @property
    def sdist_stem(self) -> str:
        return f"{self.name}-{self.version}"

    def is_source(self, rel: str) -> bool:
        """Whether the repository file ``rel`` holds code that may be mutated."""
        p = PurePosixPath(rel)
        if p.suffix != ".py" or p.name.startswith("test_") or p.name == "conftest.py":
            return False
        if "tests" in p.parts or any(rel == e or rel.startswith(e.rstrip("/") + "/") for e in self.exclude):
            return False
        return any(rel == s or rel.startswith(s.rstrip("/") + "/") for s in self.sources)

    def is_test(self, rel: str) -> bool:
        """Whether ``rel`` is part of the test suite (a candidate for hiding)."""
        return any(rel == t or rel.startswith(t.rstrip("/") + "/") for t in self.tests)


PACKAGES: dict[str, PackageSpec] = {
    p.name: p
    for p in (
        PackageSpec(
            name="inflection",
            version="0.5.1",
            sha256="1a29730d366e996aaacffb2f1f1cb9593dc38e2ddd30c91250c6dde09ea9b417",
            modules=("inflection",),
            sources=("inflection",),
            tests=("test_inflection.py",),
            style="pytest functions, heavily parametrized",
        ),
        PackageSpec(
            name="six",
            version="1.17.0",
            sha256="ff70335d468e7eb6ec65b95b99d3a2836546063f63acc5171de367e834932a81",
            modules=("six",),
            sources=("six.py",),
            tests=("test_six.py",),
            style="pytest functions",
        ),
        PackageSpec(
            name="cachetools",
            version="8.0.2",
            sha256="30ac523adfc118b51d2b2e7bad8a0ddb31370dfe2700c7f10ca224f36ccf81e0",
            modules=("cachetools",),
            sources=("src/cachetools",),
            tests=("tests",),
            style="unittest TestCase classes (mixins)",
            pythonpath="src",
        ),
        PackageSpec(
            name="toolz",
            version="1.2.0",
            sha256="9667a038e9d6ecba37995e26cb2f59ec6420b6ad8dd9677de59db9b956b08490",
            modules=("toolz", "tlz"),
            sources=("toolz",),
            tests=("toolz/tests", "toolz/sandbox/tests"),
            style="pytest functions inside the package",
            exclude=("toolz/_signatures.py", "toolz/_version.py"),
        ),
        PackageSpec(
            name="boltons",
            version="26.2.0",
            sha256="d39cfd15c1a1c3bd4d705c82252fa9edb8e4f5e8cc039f8e39afac7b1b47e92c",
            modules=("boltons",),
            sources=("boltons",),
            tests=("tests",),
            style="pytest functions with fixtures (conftest.py)",
        ),
        PackageSpec(
            name="idna",
            version="3.20",
            sha256="a7db850025b95ded1eae8a46181a1a6c56c92c96f0e2b005d9ff8dc0210cab44",
            modules=("idna",),
            sources=("idna",),
            # The UTS #46 conformance and property suites take ~30 s; the fuzz targets need atheris.
            tests=(
                "tests/test_idna.py",
                "tests/test_idna_codec.py",
                "tests/test_idna_compat.py",
                "tests/test_idna_errors.py",
                "tests/test_intranges.py",
            ),
            style="unittest TestCase classes",
            exclude=("idna/idnadata.py", "idna/uts46data.py", "idna/package_data.py"),
        ),
        PackageSpec(
            name="more-itertools",
            version="11.2.1",
            sha256="cbf08fd0af284dc69718b9b76a8e6203df624d70209ea511e4219d350c856f63",
            modules=("more_itertools",),
            sources=("more_itertools",),
            tests=("tests",),
            style="unittest TestCase classes with subTest",
        ),
    )
}

# What `raas swe build` uses without --packages, and the fast trio the integration tests build.
DEFAULT_PACKAGES: tuple[str, ...] = tuple(PACKAGES)
FAST_PACKAGES: tuple[str, ...] = ("inflection", "six", "cachetools")


def get_package(name: str) -> PackageSpec:
    try:
        return PACKAGES[name]
    except KeyError:
        raise RaasError(
            f"unknown package {name!r}; known: {', '.join(sorted(PACKAGES))}", kind="bad_request"
        ) from None


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_sdist(spec: PackageSpec, store: Path) -> Path:
    """The package's sdist in ``store`` (downloaded once with pip), its SHA-256 checked."""
    store.mkdir(parents=True, exist_ok=True)
    for have in store.glob("*.tar.gz"):
        if have.name.lower().replace("_", "-") == f"{spec.sdist_stem}.tar.gz".lower():
            if sha256_file(have) == spec.sha256:
                return have
    with tempfile.TemporaryDirectory(prefix=".dl-", dir=store) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--no-binary",
            ":all:",
            f"{spec.name}=={spec.version}",
            "-d",
            tmp,
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
        got = sorted(Path(tmp).glob("*.tar.gz"))
        if out.returncode != 0 or len(got) != 1:
            raise RaasError(
                f"pip download of {spec.name}=={spec.version} failed (exit {out.returncode}): "
                f"{(out.stdout + out.stderr)[-1500:]}",
                kind="unavailable",
            )
        digest = sha256_file(got[0])
        if digest != spec.sha256:
            raise RaasError(
                f"{got[0].name} has SHA-256 {digest}, not the pinned {spec.sha256}", kind="bad_request"
            )
        final = store / got[0].name
        shutil.move(str(got[0]), final)
        return final


def unpack_sdist(sdist: Path, dest: Path) -> Path:
    """Unpack the sdist into ``dest``; returns its single top-level directory (the repository root).

    Only regular files and directories are taken (the ``data`` filter refuses links out, devices and
    absolute names)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist, "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.isfile() or m.isdir()]
        tar.extractall(dest, members=members, filter="data")
    tops = [p for p in dest.iterdir() if p.is_dir()]
    if len(tops) != 1:
        raise RaasError(f"{sdist.name} does not unpack into one directory", kind="bad_request")
    return tops[0]


# Sdists made with SOURCE_DATE_EPOCH=0 carry 1970 times, which git refuses as a commit date.
EARLIEST_TIME = 946684800  # 2000-01-01T00:00:00Z


def sdist_time(sdist: Path) -> int:
    """When the sdist was made (its PKG-INFO's mtime, else its newest member's): the commit date of every
    instance built from it."""
    with tarfile.open(sdist, "r:gz") as tar:
        members = tar.getmembers()
    pkg_info = [int(m.mtime) for m in members if m.name.count("/") == 1 and m.name.endswith("/PKG-INFO")]
    when = (
        pkg_info[0]
        if pkg_info and pkg_info[0] >= EARLIEST_TIME
        else max((int(m.mtime) for m in members), default=0)
    )
    return max(when, EARLIEST_TIME)
