"""The op declarations (``raas.toolserver.ops``) are the one description of every tool op: the server's
validation, the host client's argument checks and typed results, and the schemas the policy sees all come
from them, and a real server answers with exactly the declared result fields."""

from __future__ import annotations

import inspect
import io
import tarfile
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from raas.agent.tools import SCHEMAS, ToolSet, sandbox_call, tool_schema, validate_arguments
from raas.errors import RaasError
from raas.sandbox.client import ToolClient, op_args
from raas.sandbox.models import RESULT_MODELS, BashSessionInfo, IPythonError
from raas.toolserver import ops, server
from raas.toolserver.protocol import ProtocolError

from .conftest import RunningServer
from .test_server import RawConn

# Each op's typed method on the host client, and the method's name for an argument where it differs.
CLIENT_METHODS: dict[tuple[str, str], tuple[str, dict[str, str]]] = {
    ("server", "ping"): ("ping", {}),
    ("server", "shutdown"): ("shutdown", {}),
    ("bash", "run"): ("bash", {}),
    ("bash", "send"): ("bash_send", {"input": "text"}),
    ("bash", "close"): ("bash_close", {}),
    ("bash", "list"): ("bash_list", {}),
    ("ipython", "run"): ("ipython", {}),
    ("ipython", "restart"): ("ipython_restart", {}),
    ("editor", "run"): ("editor", {}),
    ("gateway", "forward"): ("gateway_forward", {}),
    ("files", "upload"): ("upload_bytes", {"path": "dest"}),
    ("files", "download"): ("download", {}),
    ("files", "write"): ("write_file", {}),
    ("files", "read"): ("read_file", {}),
}
# Nested result models: (op, field) -> the model of that object (or of each item of that list).
NESTED_MODELS: dict[tuple[str, str, str], type[BaseModel]] = {
    ("bash", "list", "sessions"): BashSessionInfo,
    ("ipython", "run", "error"): IPythonError,
}


def client_drift() -> list[str]:
    """Declared arguments a typed client method cannot pass, and ops without a method."""
    problems = [f"{t}.{o} has no client method" for t, o in ops.OPS if (t, o) not in CLIENT_METHODS]
    for key, (method, renames) in CLIENT_METHODS.items():
        params = inspect.signature(getattr(ToolClient, method)).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            continue
        for arg in ops.OPS[key].args:
            if renames.get(arg.name, arg.name) not in params:
                problems.append(f"ToolClient.{method} cannot pass {key[0]}.{key[1]} argument {arg.name!r}")
    return problems


def _tag_of(annotation: Any) -> tuple[str, bool]:
    """A pydantic field annotation as (type tag, nullable)."""
    args = typing.get_args(annotation)
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        inner = [a for a in args if a is not type(None)]
        assert len(inner) == 1, annotation
        return _tag_of(inner[0])[0], True
    origin = typing.get_origin(annotation) or annotation
    if isinstance(origin, type) and issubclass(origin, BaseModel):
        return ops.OBJECT, False
    tags = {str: ops.STR, int: ops.INT, float: ops.NUM, bool: ops.BOOL, list: ops.LIST, dict: ops.OBJECT}
    return tags[origin], False


def model_drift(model: type[BaseModel], fields: tuple[ops.Field, ...], where: str) -> list[str]:
    """Where ``model`` and the declared result ``fields`` disagree (names, types, nullability)."""
    declared = {f.name: f for f in fields}
    problems = [
        f"{where}: {n} is declared but not in {model.__name__}"
        for n in declared.keys() - model.model_fields.keys()
    ]
    problems += [
        f"{where}: {model.__name__}.{n} is not declared" for n in model.model_fields.keys() - declared.keys()
    ]
    for name in declared.keys() & model.model_fields.keys():
        tag, nullable = _tag_of(model.model_fields[name].annotation)
        want = declared[name]
        if (tag, nullable) != (want.type, want.nullable):
            problems.append(
                f"{where}: {model.__name__}.{name} is {tag} (nullable {nullable}), declared {want}"
            )
    return problems


pytestmark = pytest.mark.unit


def test_typed_client_methods_cover_every_declared_argument() -> None:
    assert client_drift() == []


def test_result_models_match_the_declared_results() -> None:
    problems = []
    for (tool, op), model in RESULT_MODELS.items():
        problems += model_drift(model, ops.OPS[(tool, op)].result, f"{tool}.{op}")
    for (tool, op, field), model in NESTED_MODELS.items():
        declared = next(f for f in ops.OPS[(tool, op)].result if f.name == field)
        problems += model_drift(model, declared.fields, f"{tool}.{op}.{field}")
    assert problems == []


def test_policy_schemas_come_from_the_declaration() -> None:
    for name, tool in ops.POLICY_TOOLS.items():
        assert tool.op is not None
        params = SCHEMAS[name]["function"]["parameters"]
        shown = [a.name for a in ops.OPS[tool.op].args if a.policy] + [a.name for a in tool.extra]
        assert list(params["properties"]) == shown
        assert params["required"] == [a.name for a in ops.policy_args(tool) if a.required]
    editor = SCHEMAS["str_replace_editor"]["function"]["parameters"]["properties"]
    assert editor["command"]["enum"] == list(ops.EDITOR_COMMANDS)
    assert editor["view_range"]["items"] == {"type": "integer"}


def test_an_argument_added_to_the_declaration_reaches_server_client_and_policy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Adding one ``Arg`` to ``bash.run`` is all it takes: the server accepts and type-checks it, the client
    builds and checks it, the policy's ``bash`` schema shows it, the agent checks and forwards it; and the
    drift check says which typed client method must gain the parameter."""
    run = ops.OPS[("bash", "run")]
    added = ops.Arg("label", ops.STR, description="A tag for the command.", policy=True)
    monkeypatch.setitem(ops.OPS, ("bash", "run"), run._replace(args=(*run.args, added)))

    assert server.validate_args("bash", "run", {"command": "ls", "label": "a"}) == {
        "command": "ls",
        "label": "a",
    }
    with pytest.raises(ProtocolError) as bad:
        server.validate_args("bash", "run", {"command": "ls", "label": 3})
    assert bad.value.kind == "bad_request" and "'label' must be a string" in bad.value.message

    assert op_args("bash", "run", {"command": "ls", "label": "a", "timeout": None}) == {
        "command": "ls",
        "label": "a",
    }
    with pytest.raises(RaasError) as refused:
        op_args("bash", "run", {"command": "ls", "label": 3})
    assert refused.value.kind == "bad_request" and refused.value.message == bad.value.message

    props = tool_schema("bash")["function"]["parameters"]["properties"]
    assert props["label"] == {"type": "string", "description": "A tag for the command."}
    assert ToolSet(["bash"]).schemas[0]["function"]["parameters"]["properties"]["label"] == props["label"]
    assert validate_arguments("bash", {"command": "ls", "label": "a"}) is None
    assert "must be of type string" in (validate_arguments("bash", {"command": "ls", "label": 3}) or "")
    assert sandbox_call(ops.POLICY_TOOLS["bash"], {"command": "ls", "label": "a"}, 30.0) == (
        "bash",
        "run",
        {"command": "ls", "label": "a", "timeout": 30.0},
    )
    assert client_drift() == ["ToolClient.bash cannot pass bash.run argument 'label'"]


def test_bounds_and_hidden_arguments_follow_the_declaration(monkeypatch: pytest.MonkeyPatch) -> None:
    run = ops.OPS[("bash", "run")]
    args = tuple(a._replace(maximum=60) if a.name == "timeout" else a for a in run.args)
    monkeypatch.setitem(ops.OPS, ("bash", "run"), run._replace(args=args))
    with pytest.raises(ProtocolError) as bad:
        server.validate_args("bash", "run", {"command": "ls", "timeout": 61})
    assert "must be a number in [0, 60]" in bad.value.message
    assert tool_schema("bash")["function"]["parameters"]["properties"]["timeout"]["maximum"] == 60
    assert "must be a number in [0, 60]" in (
        validate_arguments("bash", {"command": "ls", "timeout": 61}) or ""
    )
    # The policy is capped by the agent's own limit, never past the declared bound.
    assert sandbox_call(ops.POLICY_TOOLS["bash"], {"command": "ls"}, 30.0)[2]["timeout"] == 30.0
    # Arguments without ``policy`` are the server's and the client's only.
    assert "session" not in tool_schema("bash")["function"]["parameters"]["properties"]
    assert "unknown argument(s) session" in (
        validate_arguments("bash", {"command": "ls", "session": "x"}) or ""
    )


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        ({"command": "x", "timeout": float("nan")}, "range"),
        ({"command": "x", "timeout": float("inf")}, "range"),
        ({"command": "x", "timeout": -0.5}, "range"),
        ({"command": "x", "timeout": 2**53 + 1}, "range"),
        ({"command": "x", "timeout": True}, "type"),
        ({"command": "x", "output_cap": 1.0}, "type"),
        ({"command": 1}, "type"),
    ],
)
def test_value_problems(args: dict[str, Any], problem: str) -> None:
    decl = ops.OPS[("bash", "run")]
    found = [ops.value_problem(a, args[a.name]) for a in decl.args if a.name in args]
    assert problem in found
    with pytest.raises(ops.ArgumentError):
        ops.validate_args("bash", "run", args)


def test_editor_command_choices_are_checked_everywhere() -> None:
    with pytest.raises(ProtocolError) as bad:
        server.validate_args("editor", "run", {"command": "delete", "path": "/x"})
    assert "must be one of view, create" in bad.value.message
    assert "must be one of" in (
        validate_arguments("str_replace_editor", {"command": "delete", "path": "/x"}) or ""
    )


def _tar(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _shape_problems(result: dict[str, Any], fields: tuple[ops.Field, ...], where: str) -> list[str]:
    """Where a real result differs from the declared fields (names, types, nullability, nested objects)."""
    declared = {f.name: f for f in fields}
    problems = (
        [f"{where}: answered {sorted(result)}, declared {sorted(declared)}"]
        if set(result) != set(declared)
        else []
    )
    for name, value in result.items():
        f = declared.get(name)
        if f is None or (value is None and f.nullable):
            continue
        if not ops.type_fits(f.type, value):
            problems.append(f"{where}.{name}: {value!r} is not {f.type}")
        elif f.fields:
            for item in value if f.type == ops.LIST else [value]:
                problems += _shape_problems(item, f.fields, f"{where}.{name}")
        elif f.items is not None:
            problems += [
                f"{where}.{name}: item {v!r} is not {f.items}" for v in value if not ops.type_fits(f.items, v)
            ]
    return problems


@pytest.mark.integration
async def test_a_real_server_answers_exactly_the_declared_results(fresh_server: RunningServer) -> None:
    work: Path = fresh_server.workdir
    calls: list[tuple[str, str, dict[str, Any], bytes | None]] = [
        ("server", "ping", {}, None),
        ("bash", "run", {"command": "echo hi", "session": "o"}, None),
        (
            "bash",
            "run",
            {"command": "read -r x; echo got $x", "session": "o", "no_output_timeout": 0.5},
            None,
        ),
        ("bash", "send", {"session": "o", "input": "y\n", "timeout": 10}, None),
        ("bash", "list", {}, None),
        ("bash", "close", {"session": "o"}, None),
        ("ipython", "run", {"code": "print(1); 2", "timeout": 120}, None),
        ("ipython", "run", {"code": "1/0", "timeout": 60}, None),
        ("ipython", "restart", {}, None),
        ("editor", "run", {"command": "create", "path": f"{work}/e.txt", "file_text": "a"}, None),
        ("gateway", "forward", {"socket": f"{work}/gw.sock"}, None),
        ("files", "write", {"path": f"{work}/f.txt", "mode": 0o600}, b"data"),
        ("files", "read", {"path": f"{work}/f.txt"}, None),
        ("files", "upload", {"path": f"{work}/up"}, _tar({"a.txt": b"a"})),
        ("files", "download", {"path": f"{work}/up"}, None),
        ("server", "shutdown", {}, None),
    ]
    assert {(t, o) for t, o, _, _ in calls} == set(ops.OPS)
    conn = await RawConn.open(fresh_server.socket)
    problems: list[str] = []
    try:
        for i, (tool, op, args, attachment) in enumerate(calls):
            resp = await conn.call({"v": 1, "id": i, "tool": tool, "op": op, "args": args}, attachment)
            assert resp["ok"], (tool, op, resp)
            decl = ops.OPS[(tool, op)]
            problems += _shape_problems(resp["result"], decl.result, f"{tool}.{op}")
            assert ("attachment" in resp) == decl.returns_attachment, (tool, op)
            if (tool, op) in RESULT_MODELS:
                RESULT_MODELS[(tool, op)].model_validate(resp["result"])
    finally:
        await conn.close()
    assert problems == []


@pytest.mark.integration
async def test_client_refuses_what_the_server_would_refuse(
    client: ToolClient, shared_server: RunningServer
) -> None:
    """The client checks with the same declaration before sending: same kind, same message."""
    conn = await RawConn.open(shared_server.socket)
    try:
        cases: list[tuple[str, str, dict[str, Any], bytes | None]] = [
            ("bash", "run", {"command": "x", "timeout": -1}, None),
            ("bash", "run", {"command": "x", "colour": 1}, None),
            ("editor", "run", {"command": "delete", "path": "/x"}, None),
            ("files", "read", {}, None),
            ("files", "read", {"path": "/etc/hostname"}, b"unexpected"),
        ]
        for n, (tool, op, args, attachment) in enumerate(cases):
            resp = await conn.call({"v": 1, "id": n, "tool": tool, "op": op, "args": args}, attachment)
            assert resp["ok"] is False and resp["error"]["kind"] == "bad_request", resp
            if attachment is not None:
                assert "takes no attachment" in resp["error"]["message"]
            with pytest.raises(RaasError) as refused:
                await client.call(tool, op, args, attachment=attachment)
            assert (refused.value.kind, refused.value.message) == ("bad_request", resp["error"]["message"])
        with pytest.raises(RaasError) as refused:
            await client.bash("x", timeout=float("nan"))
        assert refused.value.kind == "bad_request"
    finally:
        await conn.close()
