"""Files: tar round trips of trees, small file reads/writes, and refusal of unsafe archives."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import tarfile
from pathlib import Path

import pytest

from raas.errors import RaasError
from raas.sandbox.client import LARGE_BYTES, ToolClient, tar_directory

from .conftest import RunningServer

pytestmark = pytest.mark.integration


def make_tree(root: Path) -> None:
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("x = 1\n")
    (root / "pkg" / "sub" / "data.bin").write_bytes(bytes(range(256)) * 40)
    (root / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (root / "run.sh").chmod(0o755)
    (root / "empty").mkdir()
    (root / "link").symlink_to("pkg/__init__.py")


def snapshot(root: Path) -> dict[str, tuple[str, bytes | str, int]]:
    out: dict[str, tuple[str, bytes | str, int]] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = ("link", os.readlink(p), 0)
        elif p.is_dir():
            out[rel] = ("dir", b"", 0)
        else:
            out[rel] = ("file", p.read_bytes(), p.stat().st_mode & 0o111)
    return out


async def test_tree_round_trip(client: ToolClient, shared_server: RunningServer, tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    make_tree(src)
    dest = f"{shared_server.workdir}/{tmp_path.name}-up"
    files = await client.upload_dir(src, dest)
    assert files == 3
    r = await client.bash(f"cd {dest} && ./run.sh && cat link")
    assert r.output == "hi\nx = 1\n"
    data = await client.download(dest)
    out = tmp_path / "out"
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(out, filter="tar")
    assert snapshot(out) == snapshot(src)


async def test_single_file_download_and_write_read(client: ToolClient, shared_server: RunningServer) -> None:
    path = f"{shared_server.workdir}/deep/er/blob.bin"
    payload = os.urandom(100_000)
    await client.write_file(path, payload)
    assert await client.read_file(path) == payload
    await client.write_file(path + ".txt", "text ü")
    assert (await client.read_file(path + ".txt")).decode() == "text ü"
    with tarfile.open(fileobj=io.BytesIO(await client.download(path))) as tar:
        assert tar.getnames() == ["blob.bin"]
        member = tar.extractfile("blob.bin")
        assert member is not None and member.read() == payload


async def test_large_transfers_interleave_with_other_calls_on_one_connection(
    client: ToolClient, shared_server: RunningServer
) -> None:
    """Attachments over LARGE_BYTES go out in chunks and come back chunk by chunk: bash calls sent on the
    same connection meanwhile neither corrupt nor get corrupted by them."""
    path = f"{shared_server.workdir}/large.bin"
    payload = os.urandom(3 * LARGE_BYTES + 12345)
    text = "ü" * (LARGE_BYTES // 2 + 7)  # a str over LARGE_BYTES characters' worth of UTF-8

    async def echoes() -> list[str]:
        return [(await client.bash(f"echo {i}")).output for i in range(20)]

    async def transfers() -> None:
        for _ in range(3):
            await client.write_file(path, payload)
            assert await client.read_file(path) == payload
        await client.write_file(path + ".txt", text)
        assert (await client.read_file(path + ".txt")).decode() == text

    outputs, _ = await asyncio.gather(echoes(), transfers())
    assert outputs == [f"{i}\n" for i in range(20)]


async def test_a_cancelled_large_upload_leaves_the_connection_usable(
    client: ToolClient, shared_server: RunningServer
) -> None:
    """Cancelling the caller mid-upload does not cut the message short: the rest is still sent and the
    next calls on the same client work."""
    path = f"{shared_server.workdir}/cancelled.bin"
    payload = os.urandom(8 * LARGE_BYTES)
    upload = asyncio.create_task(client.write_file(path, payload))
    await asyncio.sleep(0)
    upload.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await upload
    assert upload.cancelled()
    # A message cut short would make the server read the next frames as the rest of the attachment.
    assert (await client.bash("echo still here")).output == "still here\n"
    await client.write_file(path + ".2", payload[::-1])
    assert await client.read_file(path + ".2") == payload[::-1]
    assert client.connected


def evil_tar(name: str, *, link: str | None = None, kind: bytes = tarfile.REGTYPE) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.type = kind
        if link is not None:
            info.linkname = link
            tar.addfile(info)
        else:
            info.size = 4
            tar.addfile(info, io.BytesIO(b"evil"))
    return buf.getvalue()


@pytest.mark.parametrize(
    "archive",
    [
        evil_tar("../escape.txt"),
        evil_tar("/abs/escape.txt"),
        evil_tar("a/../../escape.txt"),
        evil_tar("up", link="../../etc", kind=tarfile.SYMTYPE),
        evil_tar("abs", link="/etc/passwd", kind=tarfile.SYMTYPE),
        evil_tar("hard", link="../outside", kind=tarfile.LNKTYPE),
        evil_tar("dev", link=None, kind=tarfile.CHRTYPE),
    ],
)
async def test_path_traversal_refused(
    client: ToolClient, shared_server: RunningServer, tmp_path: Path, archive: bytes
) -> None:
    dest = f"{shared_server.workdir}/{tmp_path.name}-evil"
    before = set(os.listdir(shared_server.workdir))
    with pytest.raises(RaasError) as exc:
        await client.upload_bytes(archive, dest)
    assert exc.value.kind == "bad_request"
    assert set(os.listdir(shared_server.workdir)) == before
    assert not (shared_server.workdir.parent / "escape.txt").exists()


async def test_file_errors(client: ToolClient, shared_server: RunningServer) -> None:
    cases = [
        (client.read_file("/definitely/not/here"), "not_found"),
        (client.download("/definitely/not/here"), "not_found"),
        (client.read_file("relative.txt"), "bad_request"),
        (client.read_file(str(shared_server.workdir)), "tool_error"),
        (client.upload_bytes(b"not a tar at all", f"{shared_server.workdir}/x"), "bad_request"),
        (client.request("files", "write", {"path": "/tmp/x"}), "bad_request"),  # no attachment
    ]
    for coro, kind in cases:
        with pytest.raises(RaasError) as exc:
            await coro
        assert exc.value.kind == kind, exc.value


def test_tar_directory_rejects_files(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_text("x")
    with pytest.raises(RaasError):
        tar_directory(f)
