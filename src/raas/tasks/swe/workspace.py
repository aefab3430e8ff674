"""The repository inside a SWE sandbox: at the base commit, with a clean tree, hidden paths removed.

An image's repository may not be exactly at the base commit with a clean tree (environment set-up can
leave files behind). Tracked changes are reset to the base commit; untracked files the image ships are
kept (the environment may need them) but written to ``.git/info/exclude``, so they never show up as the
policy's additions in the patch (the EVAL sandbox has them too). Hidden paths (R2E-Gym's tests and test
script) are removed from the RUN sandbox before the policy starts (a hidden dir outside the workdir is a
writable copy of the image's, emptied), and checked to be gone.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from raas.errors import RaasError
from raas.sandbox.base import Sandbox

SESSION = "raas-swe-setup"
TIMEOUT_S = 300.0


@dataclass
class RepoState:
    base: str
    """The base commit, in full."""
    reset: bool = False
    """Tracked files differed from the base commit and were reset."""
    excluded: list[str] = field(default_factory=list)
    """Untracked files of the image, now ignored."""
    hidden: list[str] = field(default_factory=list)
    """Hidden paths that existed and were removed."""


def _quote_exclude(path: str) -> str:
    """``path`` as a literal, root-anchored ``.gitignore`` pattern."""
    escaped = re.sub(r"([*?\[\]\\!#])", r"\\\1", path)
    if escaped.endswith(" "):
        escaped = escaped[:-1] + "\\ "
    return "/" + escaped


async def _sh(sb: Sandbox, command: str, stage: str) -> tuple[int | None, str]:
    res = await sb.tools.bash(command, session=SESSION, timeout=TIMEOUT_S)
    if res.timed_out:
        raise RaasError(
            f"repository set-up timed out: {command[:200]}", kind="sandbox_start_failed", stage=stage
        )
    return res.exit_code, res.output


async def prepare_repo(
    sb: Sandbox, workdir: str, base_commit: str | None, *, hidden: list[str], stage: str
) -> RepoState:
    """Bring ``workdir`` to ``base_commit`` (HEAD when None) with a clean tree; remove ``hidden`` paths.

    A workdir that is not a git repository, or lacks the base commit, is a broken image
    (``sandbox_start_failed``), as is a hidden path that cannot be removed."""
    wd = shlex.quote(workdir)
    git = f"cd {wd} && GIT_CONFIG_NOSYSTEM=1 LC_ALL=C git"
    want = shlex.quote(f"{base_commit or 'HEAD'}^{{commit}}")
    code, out = await _sh(sb, f"{git} rev-parse --verify -q {want} && {git} rev-parse HEAD", stage)
    lines = out.split()
    if code != 0 or len(lines) < 2:
        raise RaasError(
            f"{workdir} in the image is not a git repository with commit {base_commit or 'HEAD'}: {out[-500:]}",
            kind="sandbox_start_failed",
            stage=stage,
        )
    state = RepoState(base=lines[-2])
    code, out = await _sh(sb, f"{git} status --porcelain --untracked-files=no", stage)
    if lines[-1] != state.base or out.strip():
        code, out = await _sh(sb, f"{git} reset -q --hard {state.base}", stage)
        if code != 0:
            raise RaasError(
                f"cannot reset {workdir} to {state.base}: {out[-500:]}",
                kind="sandbox_start_failed",
                stage=stage,
            )
        state.reset = True
    listing = "/tmp/.raas-swe-untracked"
    code, _ = await _sh(sb, f"{git} ls-files --others --exclude-standard -z > {listing}", stage)
    untracked = [
        p for p in (await sb.tools.read_file(listing)).decode(errors="surrogateescape").split("\0") if p
    ]
    if untracked:
        exclude_file = f"{workdir.rstrip('/')}/.git/info/exclude"
        code, _ = await _sh(sb, f"mkdir -p {wd}/.git/info && touch {shlex.quote(exclude_file)}", stage)
        current = await sb.tools.read_file(exclude_file)
        lines_out = "".join(_quote_exclude(p) + "\n" for p in untracked)
        await sb.tools.write_file(exclude_file, current + b"\n" + lines_out.encode(errors="surrogateescape"))
        state.excluded = untracked
    for path in hidden:
        q = shlex.quote(path)
        # A hidden dir outside the workdir is a writable copy bound over the image's: a mount point, which
        # cannot be removed, only emptied.
        remove = (
            f"if [ -e {q} ] || [ -L {q} ]; then rm -rf -- {q} 2>/dev/null; "
            f"if [ -d {q} ] && [ ! -L {q} ]; then find {q} -mindepth 1 -delete; fi; echo removed; fi"
        )
        code, out = await _sh(sb, remove, stage)
        if "removed" in out:
            state.hidden.append(path)
        check = f'if [ -L {q} ] || [ -f {q} ] || [ -n "$(ls -A {q} 2>/dev/null)" ]; then echo STILL; fi'
        code, out = await _sh(sb, check, stage)
        if "STILL" in out:
            raise RaasError(
                f"cannot hide {path} from the policy (it is in the read-only image, outside the workdir and "
                "the writable dirs)",
                kind="sandbox_start_failed",
                stage=stage,
            )
    return state
