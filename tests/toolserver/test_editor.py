"""str_replace_editor through the real server: every command and every user mistake."""

from __future__ import annotations

from pathlib import Path

import pytest

from raas.errors import RaasError
from raas.sandbox.client import ToolClient

from .conftest import RunningServer

pytestmark = pytest.mark.integration


@pytest.fixture
def edir(shared_server: RunningServer, session_name: str) -> Path:
    d = shared_server.workdir / f"ed-{session_name}"
    d.mkdir()
    return d


async def tool_error(coro) -> str:  # type: ignore[no-untyped-def]
    with pytest.raises(RaasError) as exc:
        await coro
    assert exc.value.kind == "tool_error", exc.value
    return exc.value.message


async def test_create_view_and_range(client: ToolClient, edir: Path) -> None:
    target = edir / "sub" / "a.py"
    path = str(target)
    r = await client.editor("create", path, file_text="one\ntwo\nthree\nfour\n")
    assert "created" in r.output
    assert target.read_text() == "one\ntwo\nthree\nfour\n"
    r = await client.editor("view", path)
    assert r.output.splitlines()[1:] == [
        "     1\tone",
        "     2\ttwo",
        "     3\tthree",
        "     4\tfour",
        "     5\t",
    ]
    r = await client.editor("view", path, view_range=[2, 3])
    assert r.output.splitlines()[1:] == ["     2\ttwo", "     3\tthree"]
    r = await client.editor("view", path, view_range=[3, -1])
    assert r.output.splitlines()[1] == "     3\tthree"
    msg = await tool_error(client.editor("view", path, view_range=[0, 2]))
    assert "view_range" in msg
    msg = await tool_error(client.editor("view", path, view_range=[3, 2]))
    assert "view_range" in msg
    msg = await tool_error(client.editor("create", path, file_text="x"))
    assert "already exists" in msg


async def test_directory_listing(client: ToolClient, edir: Path) -> None:
    (edir / "d1" / "d2" / "d3").mkdir(parents=True)
    (edir / "d1" / "f1").write_text("x")
    (edir / "d1" / "d2" / "deep").write_text("x")
    (edir / ".hidden").write_text("x")
    (edir / "d1" / ".hid2").mkdir()
    r = await client.editor("view", str(edir))
    lines = r.output.splitlines()[1:]
    assert lines[0] == str(edir)
    assert set(lines[1:]) == {str(edir / "d1"), str(edir / "d1" / "f1"), str(edir / "d1" / "d2")}
    msg = await tool_error(client.editor("view", str(edir), view_range=[1, 2]))
    assert "directory" in msg


async def test_str_replace_unique_and_counts(client: ToolClient, edir: Path) -> None:
    path = edir / "b.txt"
    path.write_text("".join(f"line {i}\n" for i in range(1, 21)) + "dup\ndup\n")
    r = await client.editor("str_replace", str(path), old_str="line 10\n", new_str="LINE TEN\nextra\n")
    assert "LINE TEN" in r.output and "    10\tLINE TEN" in r.output and "     6\tline 6" in r.output
    assert "line 10\n" not in path.read_text()
    msg = await tool_error(client.editor("str_replace", str(path), old_str="dup", new_str="x"))
    assert "2 times" in msg and "[22, 23]" in msg
    msg = await tool_error(client.editor("str_replace", str(path), old_str="absent", new_str="x"))
    assert "did not appear verbatim" in msg
    await client.editor("str_replace", str(path), old_str="line 20\n")
    assert "line 20" not in path.read_text()


async def test_insert_and_undo(client: ToolClient, edir: Path) -> None:
    path = edir / "c.txt"
    original = "a\nb\nc"
    path.write_text(original)
    await client.editor("insert", str(path), insert_line=0, new_str="top")
    assert path.read_text() == "top\na\nb\nc"
    r = await client.editor("insert", str(path), insert_line=2, new_str="mid1\nmid2")
    assert path.read_text() == "top\na\nmid1\nmid2\nb\nc"
    assert "     3\tmid1" in r.output
    msg = await tool_error(client.editor("insert", str(path), insert_line=99, new_str="x"))
    assert "[0, 6]" in msg
    await client.editor("undo_edit", str(path))
    assert path.read_text() == "top\na\nb\nc"
    await client.editor("undo_edit", str(path))
    assert path.read_text() == original
    msg = await tool_error(client.editor("undo_edit", str(path)))
    assert "No edit history" in msg
    created = edir / "new.txt"
    await client.editor("create", str(created), file_text="hi")
    await client.editor("undo_edit", str(created))
    assert not created.exists()


async def test_user_mistakes(client: ToolClient, edir: Path) -> None:
    missing = str(edir / "missing.txt")
    assert "does not exist" in await tool_error(client.editor("view", missing))
    assert "does not exist" in await tool_error(
        client.editor("str_replace", missing, old_str="a", new_str="b")
    )
    assert "directory" in await tool_error(client.editor("str_replace", str(edir), old_str="a", new_str="b"))
    assert "absolute" in await tool_error(client.editor("view", "relative/path.txt"))
    binary = edir / "bin.dat"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    assert "UTF-8" in await tool_error(client.editor("view", str(binary)))
    assert "required" in await tool_error(client.editor("create", str(edir / "x.txt")))
    assert "required" in await tool_error(client.editor("insert", str(binary), new_str="x"))
    with pytest.raises(RaasError) as exc:
        await client.editor("delete", str(binary))
    assert exc.value.kind == "bad_request"
