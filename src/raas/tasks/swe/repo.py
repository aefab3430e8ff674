"""Host-side git work for one instance: the single-commit repository and the two patches.

Commits are deterministic (fixed author, committer and date), so the same tree always gives the same
``base_commit``. The patches are made in a scratch repository; the repository that goes into the image is
created fresh from the buggy tree, so its object store holds exactly one commit's objects and nothing
else (no original code, no hidden tests, no reflog of earlier states).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Collection
from pathlib import Path

from raas.errors import RaasError

# Build artefacts the test runs leave behind; excluded so the tree stays clean (`git status` empty) and
# a `git diff`-based patch extraction never picks them up.
INFO_EXCLUDE = "__pycache__/\n*.py[cod]\n.pytest_cache/\n*.egg-info/\n.eggs/\nbuild/\n"
COMMIT_MESSAGE = "Initial commit"


def git_env(timestamp: int) -> dict[str, str]:
    date = f"{max(timestamp, 0)} +0000"
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": "/nonexistent",
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": "/dev/null",
        "GIT_AUTHOR_NAME": "raas",
        "GIT_AUTHOR_EMAIL": "raas@localhost",
        "GIT_COMMITTER_NAME": "raas",
        "GIT_COMMITTER_EMAIL": "raas@localhost",
        "GIT_AUTHOR_DATE": date,
        "GIT_COMMITTER_DATE": date,
        "LC_ALL": "C",
    }


def git(repo: Path, *args: str, timestamp: int = 0, input_text: str | None = None) -> str:
    out = subprocess.run(
        ["git", "-C", str(repo), *args],
        capture_output=True,
        text=True,
        check=False,
        env=git_env(timestamp),
        input=input_text,
    )
    if out.returncode != 0:
        raise RaasError(f"git {' '.join(args)} failed in {repo}: {out.stderr[-1500:]}", kind="internal")
    return out.stdout


def commit_tree(repo: Path, timestamp: int) -> str:
    """Turn directory ``repo`` into a git repository with one commit of everything in it."""
    if shutil.which("git") is None:
        raise RaasError("git is not installed on this host", kind="internal")
    git(repo, "init", "--quiet", "--initial-branch=main", timestamp=timestamp)
    (repo / ".git/info").mkdir(parents=True, exist_ok=True)
    (repo / ".git/info/exclude").write_text(INFO_EXCLUDE)
    for sample in (repo / ".git/hooks").glob("*.sample"):
        sample.unlink()
    git(repo, "config", "user.name", "raas", timestamp=timestamp)
    git(repo, "config", "user.email", "raas@localhost", timestamp=timestamp)
    git(repo, "add", "--all", "--force", timestamp=timestamp)
    git(repo, "commit", "--quiet", "--no-verify", "-m", COMMIT_MESSAGE, timestamp=timestamp)
    return git(repo, "rev-parse", "HEAD", timestamp=timestamp).strip()


def copy_tree(src: Path, dest: Path, *, skip: Collection[str] = ()) -> None:
    """Copy a source tree (no ``.git``), leaving out the relative paths in ``skip``."""

    def ignore(dirpath: str, names: list[str]) -> set[str]:
        rel = Path(dirpath).relative_to(src)
        out = {n for n in names if (rel / n).as_posix() in skip}
        if dirpath == str(src):
            out.add(".git")
        return out

    shutil.copytree(src, dest, symlinks=True, ignore=ignore)


def make_patches(
    base_tree: Path,
    fixed_files: dict[str, bytes],
    hidden_tests: dict[str, bytes],
    scratch: Path,
    timestamp: int,
) -> tuple[str, str, str]:
    """(base_commit, gold patch, test patch) for the buggy ``base_tree``.

    The gold patch turns the buggy files back into ``fixed_files``; the test patch adds ``hidden_tests``
    (files absent from the tree). Both are ``git diff --binary`` output, applied with ``git apply``."""
    repo = scratch / "patches"
    copy_tree(base_tree, repo)
    base_commit = commit_tree(repo, timestamp)
    for rel, data in fixed_files.items():
        (repo / rel).write_bytes(data)
    patch = git(repo, "diff", "--binary", "--no-color", "--no-ext-diff", timestamp=timestamp)
    git(repo, "checkout", "--quiet", "--", ".", timestamp=timestamp)
    for rel, data in hidden_tests.items():
        path = repo / rel
        if path.exists():
            raise RaasError(f"hidden test file {rel} is in the base tree", kind="internal")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    git(repo, "add", "--all", "--force", "--", *hidden_tests, timestamp=timestamp)
    test_patch = git(repo, "diff", "--cached", "--binary", "--no-color", "--no-ext-diff", timestamp=timestamp)
    shutil.rmtree(repo)
    return base_commit, patch, test_patch
