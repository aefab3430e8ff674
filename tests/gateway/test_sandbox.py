"""Agents inside real sandboxes (bwrap, apptainer; as root and, in CI, as an unprivileged user) reaching the
policy only through the gateway: the network is still off, another rollout's key is refused from inside,
and unmodified agents — mini-swe-agent, an OpenAI-SDK tool agent, an Anthropic-SDK agent — solve a small
repository task end to end with the scripted policy, their exact tokens recorded."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from tests.agent.scripted import scripted_policy, tool_call
from tests.conftest import unavailable
from tests.gateway.conftest import check_exact, sent_prompts

from raas.agent.config import AgentConfig
from raas.core.jobs import Job
from raas.gateway import Gateway
from raas.llm.tokenizer import ChatTokenizer
from raas.sandbox import SandboxConfig, SandboxManager
from raas.sandbox.config import make_config
from raas.sandbox.images import build_rootfs, rootfs_path
from raas.tasks.base import JobSandboxes
from raas.tasks.harness import HARNESS_IMAGE, HarnessHandler

pytestmark = pytest.mark.integration


@pytest.fixture(params=["bwrap", "apptainer"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="session")
def harness_image() -> Path:
    """The harness image (mini-swe-agent, openai, anthropic in /opt/raas/venv); built once by root."""
    path = rootfs_path(HARNESS_IMAGE)
    if (path / "usr").is_dir():
        return path
    if os.geteuid() != 0 or shutil.which("debootstrap") is None:
        unavailable(
            f"the harness image {path} is not built and this user cannot build it (root + debootstrap)"
        )
    return build_rootfs(HARNESS_IMAGE)


PROBE = textwrap.dedent(
    """
    import json, os, socket, sys, urllib.error, urllib.request
    base, other_key = os.environ["RAAS_GATEWAY_URL"], sys.argv[1]
    out = {}
    def call(key, path="/v1/models", body=None):
        req = urllib.request.Request(base + path, data=body, headers={"Authorization": "Bearer " + key,
                                     "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())
    out["own_key"] = call(os.environ["OPENAI_API_KEY"])[0]
    out["other_key"] = call(other_key)[0]
    out["no_key"] = call("")[0]
    body = json.dumps({"model": "p", "messages": [{"role": "user", "content": "hi"}]}).encode()
    status, reply = call(os.environ["OPENAI_API_KEY"], "/v1/chat/completions", body)
    out["completion"] = [status, reply["choices"][0]["message"]["content"]]
    status, _ = call(other_key, "/v1/chat/completions", body)
    out["other_key_completion"] = status
    def reach(host, port):
        s = socket.socket()
        s.settimeout(5)
        try:
            s.connect((host, port))
            return "connected"
        except OSError as e:
            return type(e).__name__ + ":" + str(e.errno)
        finally:
            s.close()
    out["host_llm"] = reach("127.0.0.1", int(sys.argv[2]))
    out["host_ip"] = reach(sys.argv[3], int(sys.argv[2]))
    out["internet"] = reach("1.1.1.1", 80)
    out["interfaces"] = sorted(l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:])
    print(json.dumps(out))
    """
)


def _host_ip() -> str:
    """A non-loopback address of this host (the sandbox must not reach it either)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
        return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.2"
    finally:
        s.close()


async def test_the_sandbox_reaches_the_gateway_and_nothing_else(
    tok: ChatTokenizer, sandbox_manager: SandboxManager, sandbox_config: SandboxConfig, backend: str
) -> None:
    async with scripted_policy(tok, ["hello from the policy"]) as (server, llm, _):
        gateway = Gateway(llm.balancer, tok)
        mine = gateway.open_session(
            Job(job_id="mine", instance={}, trajectory_id="t-mine"), agent=AgentConfig()
        )
        other = gateway.open_session(
            Job(job_id="other", instance={}, trajectory_id="t-other"), agent=AgentConfig()
        )
        try:
            async with sandbox_manager.sandbox(sandbox_config, owner="gw") as sb:
                env = await gateway.expose(mine, sb)
                await sb.tools.write_file("/tmp/probe.py", PROBE)
                port = server.url.rsplit(":", 1)[1]
                exports = " ".join(f"{k}={v}" for k, v in env.items())
                r = await sb.tools.bash(
                    f"env {exports} python3 /tmp/probe.py {other.key} {port} {_host_ip()}", timeout=120
                )
                assert r.exit_code == 0, r.output
                seen = json.loads(r.output.strip().splitlines()[-1])
        finally:
            await gateway.aclose()
    assert seen["own_key"] == 200
    assert seen["other_key"] == seen["no_key"] == seen["other_key_completion"] == 401
    assert seen["completion"] == [200, "hello from the policy"]
    assert seen["host_llm"].startswith("ConnectionRefusedError")  # the sandbox's own loopback: nothing there
    assert seen["host_ip"] != "connected" and seen["internet"] != "connected"
    assert seen["interfaces"] == ["lo"]
    assert len(mine.turns) == 1 and other.turns == [] and other.stats.requests == 0
    assert len(server.requests) == 1


TASK_FILES = {"calc.py": "def add(a, b):\n    return a - b\n", "README.md": "A calculator.\n"}
GOLD_PATCH = """diff --git a/calc.py b/calc.py
--- a/calc.py
+++ b/calc.py
@@ -1,2 +1,2 @@
 def add(a, b):
-    return a - b
+    return a + b
"""
HIDDEN_TEST = "import calc\n\nassert calc.add(2, 3) == 5\nassert calc.add(-1, 1) == 0\nprint('ok')\n"


def harness_instance(agent: str, **extra: Any) -> dict[str, Any]:
    return {
        "data_source": "harness",
        "instance_id": f"calc-{agent}",
        "agent": agent,
        "task": "calc.add(2, 3) returns -1 but must return 5. Fix calc.py.",
        "files": TASK_FILES,
        "tests": {"test_calc.py": HIDDEN_TEST},
        "check": "python3 test_calc.py",
        "timeout_s": 240,
        "max_steps": 8,
        **extra,
    }


def gold_script(submit: str) -> list[str]:
    """The policy's turns: look, type the gold patch through bash, submit."""
    fix = f"cat > /tmp/fix.patch <<'EOF'\n{GOLD_PATCH}EOF\ngit apply /tmp/fix.patch && python3 -c 'import calc; print(calc.add(2, 3))'"
    return [
        "Let me read the code first.\n" + tool_call("bash", command="cat calc.py"),
        "add subtracts; I will apply the fix.\n" + tool_call("bash", command=fix),
        submit,
    ]


async def _run_harness(
    tok: ChatTokenizer, job_sandboxes: JobSandboxes, inst: dict[str, Any], texts: list[str]
) -> tuple[Any, Any, Any]:
    handler = HarnessHandler()
    handler.validate_instance(inst)
    job = Job(job_id="gw-job", instance=inst, trajectory_id="gw-traj")
    env = await handler.init(job, job_sandboxes)
    async with scripted_policy(tok, texts, AgentConfig(max_turns=8, max_tokens_per_turn=1024)) as (
        server,
        llm,
        _,
    ):
        out = await handler.run(job, env, llm)
        sent = sent_prompts(server)
    await job_sandboxes.close_all()  # as the pipeline does before EVAL
    env.run_output = out
    result = await handler.eval(job, env)
    return out, result, sent


@pytest.fixture
def harness_config(
    backend: str, backend_available: dict[str, str | None], harness_image: Path
) -> SandboxConfig:
    reason = backend_available.get(backend)
    if reason:
        unavailable(reason)
    return make_config(backend=backend, image=str(harness_image), start_timeout_s=120)


@pytest.fixture
async def harness_sandboxes(
    sandbox_manager: SandboxManager, harness_config: SandboxConfig
) -> AsyncIterator[JobSandboxes]:
    js = JobSandboxes(sandbox_manager, harness_config, owner="gw-job")
    try:
        yield js
    finally:
        await js.close_all()


async def test_mini_swe_agent_solves_the_task_through_the_gateway(
    tok: ChatTokenizer, harness_sandboxes: JobSandboxes
) -> None:
    texts = gold_script(tool_call("bash", command="echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"))
    out, result, sent = await _run_harness(tok, harness_sandboxes, harness_instance("mini-swe-agent"), texts)
    agent = out.artifacts["agent"]
    assert agent["exit_code"] == 0 and not agent["timed_out"], agent["log_tail"]
    assert result.reward == 1.0 and result.resolved, result.details
    assert "+    return a + b" in out.artifacts["patch"]
    gw = out.artifacts["gateway"]
    assert gw["by_api"] == {"chat": 3} and gw["continued"] == 2 and len(gw["segments"]) == 1
    assert out.finish_reason == "agent_exit" and len(out.turns) == 3
    check_exact(out, sent)
    # mini-swe-agent re-sent its history verbatim: nothing was re-tokenized, and nothing would drift
    assert gw["drift"] == {"resent_replies": 2, "retokenize_differently": []}
    assert "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" in tok.decode(out.token_trajectory.prompt_ids)
    assert (
        "model.model_kwargs.api_key=<rollout key>" in agent["log_tail"]
    )  # mini prints it; the key is not kept


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_sdk_agent_solves_the_task(
    tok: ChatTokenizer, harness_sandboxes: JobSandboxes, stream: bool
) -> None:
    inst = harness_instance("openai-tools", env={"RAAS_AGENT_STREAM": "1" if stream else "0"})
    out, result, sent = await _run_harness(tok, harness_sandboxes, inst, gold_script(tool_call("submit")))
    assert out.artifacts["agent"]["exit_code"] == 0, out.artifacts["agent"]["log_tail"]
    assert result.reward == 1.0 and result.resolved
    assert len(out.turns) == 3 and out.artifacts["gateway"]["continued"] == 2
    check_exact(out, sent)


ANTHROPIC_AGENT = textwrap.dedent(
    """
    import json, subprocess, sys
    import anthropic
    task = json.load(sys.stdin)["task"]
    client = anthropic.Anthropic()  # ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY
    tools = [{"name": "bash", "description": "run bash", "input_schema": {"type": "object",
              "properties": {"command": {"type": "string"}}, "required": ["command"]}},
             {"name": "submit", "description": "done", "input_schema": {"type": "object", "properties": {}}}]
    messages = [{"role": "user", "content": task}]
    for _ in range(8):
        with client.messages.stream(model="policy", max_tokens=1024, system="Fix the repository.",
                                    messages=messages, tools=tools) as stream:
            reply = stream.get_final_message()
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        results = []
        for block in reply.content:
            if block.type == "tool_use" and block.name == "submit":
                sys.exit(0)
            if block.type == "tool_use":
                done = subprocess.run(["bash", "-c", block.input["command"]], capture_output=True, text=True)
                results.append({"type": "tool_result", "tool_use_id": block.id, "content": done.stdout + done.stderr})
        messages.append({"role": "user", "content": results or "Use a tool."})
    sys.exit(1)
    """
)


async def test_anthropic_sdk_agent_solves_the_task(
    tok: ChatTokenizer, harness_sandboxes: JobSandboxes
) -> None:
    command = f'"$RAAS_AGENT_BIN/python" -c {shlex.quote(ANTHROPIC_AGENT)}'
    inst = harness_instance("command", command=command)
    out, result, sent = await _run_harness(tok, harness_sandboxes, inst, gold_script(tool_call("submit")))
    assert out.artifacts["agent"]["exit_code"] == 0, out.artifacts["agent"]["log_tail"]
    assert result.reward == 1.0
    gw = out.artifacts["gateway"]
    assert gw["by_api"] == {"messages": 3} and gw["continued"] == 2
    check_exact(out, sent)


async def test_an_agent_that_does_nothing_scores_zero_and_a_timeout_is_reported(
    tok: ChatTokenizer, harness_sandboxes: JobSandboxes
) -> None:
    out, result, _ = await _run_harness(
        tok, harness_sandboxes, harness_instance("command", command="true"), ["unused"]
    )
    assert result.reward == 0.0 and result.resolved is False and out.turns == []
    assert out.artifacts["patch"] == "" and out.finish_reason == "agent_exit"
    inst = harness_instance("command", command="sleep 600", timeout_s=2)
    out, result, _ = await _run_harness(tok, harness_sandboxes, inst, ["unused"])
    assert out.artifacts["agent"]["timed_out"] and out.finish_reason == "agent_timeout"
    assert result.reward == 0.0
