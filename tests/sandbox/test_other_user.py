"""The attack tests' other user finds its commands as that user would, whatever root's PATH holds."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.sandbox.other_user import SYSTEM_PATH, as_nobody, system_command

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(os.geteuid() != 0, reason="only root can run a command as another user"),
]


def test_a_shim_first_on_roots_path_is_not_what_the_other_user_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A pyenv-style shim in a directory only root may enter, first on root's PATH.
    shims = tmp_path / "shims"
    shims.mkdir(mode=0o700)
    (shims / "python3").write_text('#!/usr/bin/env bash\nexec /usr/bin/env -i python3 "$@"\n')
    (shims / "python3").chmod(0o755)
    monkeypatch.setenv("PATH", f"{shims}:{os.environ['PATH']}")
    system_command.cache_clear()
    try:
        r = as_nobody("python3", "-c", "import os, sys; print(os.getuid(), sys.executable)")
    finally:
        system_command.cache_clear()
    assert r.returncode == 0, r.stderr
    uid, exe = r.stdout.split()
    assert uid == "65534" and not exe.startswith(str(shims))
    assert any(exe.startswith(d + "/") for d in SYSTEM_PATH.split(":")), exe


def test_a_command_the_other_user_cannot_find_fails_with_its_name() -> None:
    with pytest.raises(pytest.fail.Exception, match="no 'raas-no-such-command' in the system's directories"):
        system_command("raas-no-such-command")
