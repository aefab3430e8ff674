"""A llama-server that dies while loading is reported by name, with a hint, and leaves nothing behind.

The crash cannot be produced on demand with the real binary (it takes a CPU whose hypervisor refuses
instructions the CPU advertises), so these tests run ``EmbeddedServer`` against test doubles: tiny shell
scripts standing in for ``llama-server`` that log a line the way it does and then die the way it does.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from raas.errors import RaasError
from raas.llm.embedded import EmbeddedServer, ServerCrashed

pytestmark = pytest.mark.integration


def fake_llama_server(tmp_path: Path, death: str) -> tuple[Path, Path]:
    """A shell script posing as llama-server: it logs, counts its runs, then runs ``death``."""
    runs = tmp_path / "runs"
    script = tmp_path / "fake-llama-server-test-double"
    script.write_text(
        "#!/bin/sh\n"
        "ulimit -c 0\n"  # no core file from the signal
        f"echo run >> '{runs}'\n"
        'echo "load_tensors: loading model tensors from $2 (test double for llama-server)"\n'
        f"{death}\n"
    )
    script.chmod(0o755)
    return script, runs


def _server(binary: Path, tmp_path: Path) -> EmbeddedServer:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"never read by the test double")
    return EmbeddedServer(model, parallel=1, ctx_per_slot=256, threads=1, startup_timeout_s=30, binary=binary)


async def test_sigill_at_load_names_the_signal_and_the_fix(tmp_path: Path) -> None:
    binary, runs = fake_llama_server(tmp_path, "kill -s ILL $$")
    srv = _server(binary, tmp_path)
    with pytest.raises(ServerCrashed) as err:
        await srv.start()
    exc = err.value
    assert exc.kind == "llm_unavailable" and exc.returncode == -signal.SIGILL
    assert exc.signal_name == "SIGILL"
    assert "killed by SIGILL" in exc.message and "exited with -4" not in exc.message
    assert exc.hint is not None
    for fix in ("CPU instructions this machine does not allow", "make install", "LLAMA_ARG_REPACK=false"):
        assert fix in exc.message
    assert "test double for llama-server" in exc.message  # the log's last lines come with it
    # a crash is not retried on another port: it would only crash again
    assert runs.read_text().splitlines() == ["run"]
    assert srv.proc is None and srv._tmp is None and not srv.running


@pytest.mark.parametrize(
    ("death", "name", "words"),
    [
        ("kill -s SEGV $$", "SIGSEGV", "corrupt or truncated model file"),
        ("kill -s ABRT $$", "SIGABRT", "failed internal check"),
        ("kill -s KILL $$", "SIGKILL", "out-of-memory killer"),
        ("kill -s USR1 $$", "SIGUSR1", None),
    ],
)
async def test_other_signals_are_named(tmp_path: Path, death: str, name: str, words: str | None) -> None:
    binary, _ = fake_llama_server(tmp_path, death)
    with pytest.raises(ServerCrashed) as err:
        await _server(binary, tmp_path).start()
    assert err.value.signal_name == name and f"killed by {name}" in err.value.message
    assert (words in err.value.message) if words else err.value.hint is None


async def test_plain_exit_status_is_not_called_a_signal(tmp_path: Path) -> None:
    binary, runs = fake_llama_server(tmp_path, "echo 'error: failed to load model' ; exit 1")
    with pytest.raises(ServerCrashed) as err:
        await _server(binary, tmp_path).start()
    assert err.value.signal_name is None and err.value.hint is None
    assert "exited with status 1" in err.value.message and "failed to load model" in err.value.message
    assert runs.read_text().splitlines() == ["run"]


async def test_a_binary_that_cannot_run_is_a_typed_error(tmp_path: Path) -> None:
    for binary in (tmp_path / "no-such-llama-server", tmp_path):
        srv = _server(binary, tmp_path)
        with pytest.raises(RaasError) as err:
            await srv.start()
        assert err.value.kind == "llm_unavailable" and f"cannot run {binary}" in err.value.message
        assert srv.proc is None and srv._tmp is None
