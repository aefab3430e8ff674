"""The policy's patch: what it changed in the repository, taken from the RUN sandbox before it closes.

``git add -A`` then ``git diff --cached --binary BASE``: every change against the base commit (edits,
new and deleted files, mode changes, binary files as git binary patches), whatever the policy did to the
index or its own commits in between. Files the hidden test patch writes (and hidden paths inside the
repository) are left out, as SWE-bench's harness resets them, so the test patch always applies on top.

The diff runs in a fresh bash session with a clean environment and explicit options (no colour, no
external diff or textconv, ``a/``/``b/`` prefixes, no rename detection so ``patch`` can apply it too), so
nothing the policy set in its shell or in the repository's git config changes its format. A diff that is
not valid UTF-8 (an edited Latin-1 file) is made again with every changed file as a git binary patch, so
``git_patch`` is always text and applies byte for byte.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from raas.errors import RaasError
from raas.sandbox.base import Sandbox

SESSION = "raas-swe-patch"
SCRIPT = "/tmp/.raas-swe-extract.sh"
TIMEOUT_S = 300.0

_EXTRACT = r"""set -u
cd "$1" || { echo "RAAS_NO_REPO"; exit 0; }
base="$2"; all_binary="$3"; shift 3
out=$(mktemp -d) || exit 1
export HOME="$out" GIT_CONFIG_NOSYSTEM=1 LC_ALL=C GIT_TERMINAL_PROMPT=0
if ! git add -A -- . >"$out/log" 2>&1; then echo "RAAS_GIT_FAILED add"; tail -c 2000 "$out/log"; exit 0; fi
if [ "$all_binary" = 1 ]; then  # info/attributes outranks the repository's .gitattributes
  attrs=$(git rev-parse --git-path info/attributes) && mkdir -p "$(dirname "$attrs")" \
    && printf '* -diff\n' >> "$attrs" || { echo "RAAS_GIT_FAILED attributes"; exit 0; }
fi
if ! git -c core.quotePath=true -c diff.noprefix=false diff --cached --binary --no-color \
    --no-ext-diff --no-textconv --no-renames --src-prefix=a/ --dst-prefix=b/ "$base" -- . "$@" \
    >"$out/patch" 2>"$out/log"; then
  echo "RAAS_GIT_FAILED diff"; tail -c 2000 "$out/log"; exit 0
fi
git diff --cached --name-only -z --no-renames "$base" -- . "$@" >"$out/files" 2>/dev/null
echo "RAAS_PATCH $out $(stat -c %s "$out/patch")"
"""


@dataclass
class ExtractedPatch:
    """What :func:`extract_patch` found."""

    text: str
    """The patch (``""``: no change, or too large)."""
    files: list[str] = field(default_factory=list)
    size: int = 0
    """Bytes of the diff git produced."""
    too_large: bool = False
    binary_fallback: bool = False
    """Every changed file is a git binary patch (the plain diff was not valid UTF-8)."""
    problem: str | None = None
    """Why no patch could be taken (the policy broke the repository): then ``text`` is empty."""


def exclude_pathspecs(paths: list[str]) -> list[str]:
    """Git pathspecs leaving ``paths`` (relative to the repository root) out of a diff, taken literally."""
    return [f":(top,literal,exclude){p}" for p in paths if p]


async def _run(sb: Sandbox, workdir: str, base: str, excludes: list[str], all_binary: bool) -> str:
    args = " ".join(shlex.quote(a) for a in [workdir, base, "1" if all_binary else "0", *excludes])
    res = await sb.tools.bash(
        f"/bin/bash --noprofile --norc {SCRIPT} {args}", session=SESSION, timeout=TIMEOUT_S
    )
    if res.timed_out:
        raise RaasError(f"taking the patch took longer than {TIMEOUT_S:g}s", kind="eval_error", stage="run")
    return res.output


async def extract_patch(
    sb: Sandbox, *, workdir: str, base: str, exclude: list[str], cap_bytes: int
) -> ExtractedPatch:
    """The policy's changes in ``workdir`` against ``base`` as a binary-safe git diff (see module doc).

    A repository the policy broke (``.git`` removed) gives ``problem`` and no patch: the policy's doing.
    A sandbox that died raises (infrastructure)."""
    await sb.tools.write_file(SCRIPT, _EXTRACT.encode())
    excludes = exclude_pathspecs(exclude)
    for all_binary in (False, True):
        output = await _run(sb, workdir, base, excludes, all_binary)
        line = next((ln for ln in output.splitlines() if ln.startswith("RAAS_")), "")
        if not line.startswith("RAAS_PATCH "):
            return ExtractedPatch("", problem=(line or "no result") + ": " + output[-2000:].strip())
        _, out_dir, size_s = line.split()
        size = int(size_s)
        files = [
            f
            for f in (await sb.tools.read_file(f"{out_dir}/files")).decode(errors="replace").split("\0")
            if f
        ]
        if size > cap_bytes:
            return ExtractedPatch("", files, size, too_large=True)
        raw = await sb.tools.read_file(f"{out_dir}/patch")
        try:
            return ExtractedPatch(raw.decode("utf-8"), files, size, binary_fallback=all_binary)
        except UnicodeDecodeError:
            continue
    raise RaasError("a git binary diff was not valid UTF-8", kind="eval_error", stage="run")
