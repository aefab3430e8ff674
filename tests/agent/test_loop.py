"""The agent loop against a scripted policy (vLLM wire protocol), the real balancer, the real SmolLM2 chat
tokenizer and a real local sandbox."""

from __future__ import annotations

import pytest
from tests.agent.scripted import completions, make_job, scripted_policy, tool_call
from tests.doubles.scripted_llm import ScriptedLLM, replay

from raas.agent.config import AgentConfig
from raas.agent.context import LLMContext
from raas.agent.loop import run_agent
from raas.agent.tools import ToolSet
from raas.core import metrics
from raas.core.jobs import Job
from raas.core.trajectory import RunOutput
from raas.errors import RaasError
from raas.llm.balancer import LLMBalancer
from raas.llm.tokenizer import ChatTokenizer
from raas.sandbox import Sandbox

pytestmark = pytest.mark.integration

TOOLS = ToolSet(["bash", "ipython", "finish"])


def assert_token_exact(out: RunOutput, server: ScriptedLLM) -> None:
    """Every turn's prompt is exactly what the server received and every output exactly what it sent;
    the flattened trajectory and the messages both reproduce that sequence."""
    assert len(out.turns) == len(server.requests)
    seq: list[int] = []
    for turn, req in zip(out.turns, server.requests, strict=True):
        seq += turn.prompt_ids
        assert turn.prompt_len == len(seq)
        assert seq == req.prompt_ids
        seq += turn.output_ids
    traj = out.token_trajectory
    assert traj.prompt_ids + traj.response_ids == seq
    assert len(traj.loss_mask) == len(traj.response_ids) == len(traj.logprobs)
    sampled = [t for turn in out.turns for t in turn.output_ids]
    assert [t for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m == 1] == sampled
    assert [lp for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True) if m == 1] == [
        lp for turn in out.turns for lp in turn.logprobs
    ]
    assert all(lp == 0.0 for lp, m in zip(traj.logprobs, traj.loss_mask, strict=True) if m == 0)
    from_messages = [t for m in out.messages for t in m.input_ids + (m.output_ids or [])]
    assert from_messages == seq


async def test_tool_then_finish_is_token_exact(tokenizer: ChatTokenizer, sandbox: Sandbox) -> None:
    texts = [
        "Let me compute.\n" + tool_call("bash", command="echo $((6*7))"),
        tool_call("finish", answer="42"),
    ]
    async with scripted_policy(tokenizer, texts) as (server, llm, script):
        out = await run_agent(
            make_job(), sandbox, llm, TOOLS, user_prompt="What is 6 times 7?", system_prompt="Solve it."
        )
    assert out.finish_reason == "finish_tool"
    assert out.answer == "42"
    assert out.artifacts["tools"] == TOOLS.schemas  # what the policy was shown, for the trainer
    assert [t.output_ids for t in out.turns] == [c.token_ids for c in script]
    assert [t.logprobs for t in out.turns] == [c.logprobs for c in script]
    assert all(t.server == server.url for t in out.turns)
    assert_token_exact(out, server)
    roles = [m.role for m in out.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    tool_msg = out.messages[3]
    assert tool_msg.name == "bash" and "42" in tool_msg.content and "[exit code 0]" in tool_msg.content
    # The observation really reached the policy: its text is in the second prompt.
    assert "42\n[exit code 0]" in tokenizer.decode(server.requests[1].prompt_ids)
    # Tools were described to the policy (SmolLM2's template has no tool support: injected Hermes block).
    first_prompt = tokenizer.decode(server.requests[0].prompt_ids)
    assert '"name": "bash"' in first_prompt and "<tool_call>" in first_prompt
    assert out.metrics["tool_calls"] == 2 and out.metrics.get("malformed_tool_calls", 0) == 0


async def test_malformed_and_invalid_calls_become_error_observations(
    tokenizer: ChatTokenizer, sandbox: Sandbox
) -> None:
    texts = [
        '<tool_call>\n{"name": "bash", "arguments": {"command": "echo hi"\n</tool_call>',  # broken JSON
        tool_call("no_such_tool", x=1),
        tool_call("bash", cmd="echo wrong-arg-name"),
        tool_call("finish", answer="7"),
    ]
    async with scripted_policy(tokenizer, texts) as (server, llm, _):
        out = await run_agent(make_job(), sandbox, llm, TOOLS, user_prompt="q")
    assert out.finish_reason == "finish_tool" and out.answer == "7"
    assert out.metrics["malformed_tool_calls"] == 3
    tool_msgs = [m for m in out.messages if m.role == "tool"]
    assert len(tool_msgs) == 3
    assert all(m.content.startswith("Error") for m in tool_msgs)
    assert "no_such_tool" in tool_msgs[1].content and "command" in tool_msgs[2].content
    assert "Error" in tokenizer.decode(server.requests[1].prompt_ids[len(server.requests[0].prompt_ids) :])
    assert_token_exact(out, server)


async def test_loop_detection_stops_before_the_repeat_runs(
    tokenizer: ChatTokenizer, sandbox: Sandbox
) -> None:
    call = tool_call("bash", command="echo x >> loop-count && wc -l < loop-count")
    await sandbox.tools.bash("rm -f loop-count")
    async with scripted_policy(tokenizer, [call] * 5) as (server, llm, _):
        out = await run_agent(
            make_job(), sandbox, llm, TOOLS, AgentConfig(loop_detection_repeats=3), user_prompt="q"
        )
    assert out.finish_reason == "loop_detected"
    assert len(server.requests) == 3
    assert (await sandbox.tools.bash("wc -l < loop-count")).output.strip() == "2"
    assert_token_exact(out, server)


async def test_context_budget_bounds_the_trajectory(tokenizer: ChatTokenizer, sandbox: Sandbox) -> None:
    texts = [tool_call("bash", command="seq 1 400")] * 3
    async with scripted_policy(tokenizer, texts) as (server, llm, _):
        prompt_len = len(
            llm.tokenizer.conversation(
                [{"role": "system", "content": ""}, {"role": "user", "content": "q"}], tools=TOOLS.schemas
            ).prompt_ids
        )
        budget = prompt_len + 120
        out = await run_agent(
            make_job(), sandbox, llm, TOOLS, AgentConfig(context_budget=budget), user_prompt="q"
        )
    assert out.finish_reason == "context_budget"
    traj = out.token_trajectory
    assert len(traj.prompt_ids) + len(traj.response_ids) <= budget
    assert len(server.requests) == 1  # the observation (~1.6 KB of numbers) left no room for turn 2
    assert out.artifacts["unseen_observations"][0]["name"] == "bash"
    assert out.messages[-1].role == "assistant"
    assert_token_exact(out, server)


async def test_max_tokens_per_turn_is_capped_by_the_remaining_budget(
    tokenizer: ChatTokenizer, sandbox: Sandbox
) -> None:
    async with scripted_policy(tokenizer, [tool_call("finish", answer="1")]) as (server, llm, _):
        prompt_len = len(
            llm.tokenizer.conversation(
                [{"role": "system", "content": ""}, {"role": "user", "content": "q"}], tools=TOOLS.schemas
            ).prompt_ids
        )
        await run_agent(
            make_job(),
            sandbox,
            llm,
            TOOLS,
            AgentConfig(context_budget=prompt_len + 30, max_tokens_per_turn=500),
            user_prompt="q",
        )
    assert server.requests[0].max_tokens == 30


async def test_no_tool_call_stops_or_nudges(tokenizer: ChatTokenizer, sandbox: Sandbox) -> None:
    async with scripted_policy(tokenizer, ["The answer is 42."]) as (server, llm, _):
        out = await run_agent(
            make_job(), sandbox, llm, TOOLS, AgentConfig(stop_on_no_tool_call=True), user_prompt="q"
        )
    assert out.finish_reason == "no_tool_call" and out.answer is None
    assert_token_exact(out, server)

    texts = ["The answer is 42.", tool_call("finish", answer="42")]
    async with scripted_policy(tokenizer, texts) as (server, llm, _):
        out = await run_agent(
            make_job(), sandbox, llm, TOOLS, AgentConfig(stop_on_no_tool_call=False), user_prompt="q"
        )
    assert out.finish_reason == "finish_tool" and out.answer == "42"
    assert [m.role for m in out.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert_token_exact(out, server)


async def test_max_turns_keeps_last_observation_out_of_the_sequence(
    tokenizer: ChatTokenizer, sandbox: Sandbox
) -> None:
    texts = [tool_call("bash", command="echo one"), tool_call("bash", command="echo two > mt.txt")]
    async with scripted_policy(tokenizer, texts) as (server, llm, _):
        out = await run_agent(make_job(), sandbox, llm, TOOLS, AgentConfig(max_turns=2), user_prompt="q")
    assert out.finish_reason == "max_turns"
    assert out.messages[-1].role == "assistant"
    # The last call still ran (its side effects count for evaluation) but the policy never saw its result.
    assert (await sandbox.tools.bash("cat mt.txt")).output.strip() == "two"
    assert out.artifacts["unseen_observations"][0]["content"].startswith("(no output)")
    assert_token_exact(out, server)


async def test_observations_are_truncated(tokenizer: ChatTokenizer, sandbox: Sandbox) -> None:
    texts = [
        tool_call("bash", command="head -c 5000 /dev/zero | tr '\\0' a"),
        tool_call("finish", answer="x"),
    ]
    async with scripted_policy(tokenizer, texts) as (server, llm, _):
        out = await run_agent(
            make_job(), sandbox, llm, TOOLS, AgentConfig(observation_cap_bytes=1000), user_prompt="q"
        )
    obs = out.messages[3].content
    assert "bytes truncated" in obs and len(obs.encode()) < 1100
    assert_token_exact(out, server)


async def test_sampling_params_reach_the_server(tokenizer: ChatTokenizer, sandbox: Sandbox) -> None:
    job = make_job(temperature=0.5, seed=7, model="ignored-client-field", max_turns=3)
    async with scripted_policy(tokenizer, [tool_call("finish", answer="1")]) as (server, llm, _):
        await run_agent(job, sandbox, llm, TOOLS, AgentConfig(max_tokens_per_turn=64), user_prompt="q")
    body = server.requests[0].body
    assert body["temperature"] == 0.5 and body["seed"] == 7 and body["max_tokens"] == 64
    assert "model" not in body or body["model"] != "ignored-client-field"


async def test_the_samples_of_a_group_reach_one_server(tokenizer: ChatTokenizer, sandbox: Sandbox) -> None:
    """The loop passes the job's group key: a group's samples share a server, other groups spread."""
    finish = completions(tokenizer, [tool_call("finish", answer="1")])
    async with ScriptedLLM(replay(finish, cycle=True)) as a, ScriptedLLM(replay(finish, cycle=True)) as b:
        balancer = LLMBalancer(health_interval_s=0)
        balancer.add(a.url)
        balancer.add(b.url)
        llm = LLMContext(balancer, tokenizer, AgentConfig())

        async def servers(instance: dict[str, object], job_id: str) -> set[str]:
            job = Job(job_id=job_id, instance=instance, trajectory_id=job_id)
            out = await run_agent(job, sandbox, llm, TOOLS, user_prompt="q")
            return {t.server for t in out.turns}

        try:
            grouped = [await servers({"instance_id": "i", "group_id": "grp"}, f"s{i}") for i in range(4)]
            spread = [await servers({"instance_id": f"i{i}"}, f"o{i}") for i in range(4)]
            assert balancer.group_counts()["live"] == 0  # each trajectory was released at its end
        finally:
            await balancer.aclose()
    assert len(set.union(*grouped)) == 1
    assert set.union(*spread) == {a.url, b.url}


async def test_llm_down_is_a_typed_infrastructure_error(tokenizer: ChatTokenizer, sandbox: Sandbox) -> None:
    balancer = LLMBalancer(health_interval_s=0, retries=0)
    balancer.add("http://127.0.0.1:9")  # discard port: nothing listens
    try:
        with pytest.raises(RaasError) as e:
            await run_agent(
                make_job(), sandbox, LLMContext(balancer, tokenizer, AgentConfig()), TOOLS, user_prompt="q"
            )
    finally:
        await balancer.aclose()
    assert e.value.kind == "llm_unavailable"


async def test_dead_sandbox_is_a_typed_infrastructure_error(
    tokenizer: ChatTokenizer, sandbox: Sandbox
) -> None:
    await sandbox.close()
    async with scripted_policy(tokenizer, [tool_call("bash", command="echo hi")]) as (_, llm, _s):
        with pytest.raises(RaasError) as e:
            await run_agent(make_job(), sandbox, llm, TOOLS, user_prompt="q")
    assert e.value.kind == "sandbox_dead"


async def test_editor_and_submit_with_weight_version(tokenizer: ChatTokenizer, sandbox: Sandbox) -> None:
    path = sandbox.workspace / "notes.txt"  # the local backend works in its host workspace directly
    texts = [
        tool_call("str_replace_editor", command="create", path=str(path), file_text="alpha\nbeta\n"),
        tool_call(
            "str_replace_editor", command="str_replace", path=str(path), old_str="beta", new_str="gamma"
        ),
        tool_call("str_replace_editor", command="view", path=str(path)),
        tool_call("str_replace_editor", command="str_replace", path=str(path), old_str="nope", new_str="x"),
        tool_call("submit"),
    ]
    tools = ToolSet(["bash", "str_replace_editor", "submit"])
    async with scripted_policy(tokenizer, texts, weight_version="w7") as (server, llm, _):
        out = await run_agent(make_job(), sandbox, llm, tools, AgentConfig(max_turns=6), user_prompt="edit")
    assert out.finish_reason == "finish_tool" and out.answer is None
    assert all(t.weight_version == "w7" for t in out.turns)
    observations = [m.content for m in out.messages if m.role == "tool"]
    assert "gamma" in observations[2] and "beta" not in observations[2]
    assert observations[3].startswith("Error (tool_error)")  # a user mistake, shown to the policy
    assert out.metrics["tool_errors"] == 1
    assert (await sandbox.tools.read_file(str(path))) == b"alpha\ngamma\n"
    assert_token_exact(out, server)


def _tool_calls_recorded(tool: str, ok: bool) -> float:
    """How many calls of ``tool`` the process-wide Prometheus histogram has seen so far."""
    value = metrics.REGISTRY.get_sample_value(
        "raas_tool_latency_seconds_count", {"tool": tool, "ok": str(ok).lower()}
    )
    return value or 0.0


async def test_every_dispatched_tool_call_is_recorded_in_the_latency_metric(
    tokenizer: ChatTokenizer, sandbox: Sandbox
) -> None:
    missing = sandbox.workspace / "missing.txt"
    texts = [
        tool_call("bash", command="echo one"),
        tool_call("bash", command="echo two"),
        tool_call("str_replace_editor", command="view", path=str(missing)),  # fails in the sandbox
        tool_call("no_such_tool", x=1),  # never reaches the sandbox: not a tool call to time
        tool_call("finish", answer="done"),
    ]
    tools = ToolSet(["bash", "str_replace_editor", "finish"])
    keys = [("bash", True), ("bash", False), ("str_replace_editor", True), ("str_replace_editor", False)]
    before = {k: _tool_calls_recorded(*k) for k in keys}
    async with scripted_policy(tokenizer, texts) as (_, llm, _s):
        out = await run_agent(make_job(), sandbox, llm, tools, AgentConfig(max_turns=6), user_prompt="q")
    assert out.finish_reason == "finish_tool"
    delta = {k: _tool_calls_recorded(*k) - before[k] for k in keys}
    assert delta == {
        ("bash", True): 2,
        ("bash", False): 0,
        ("str_replace_editor", True): 0,
        ("str_replace_editor", False): 1,
    }
    assert _tool_calls_recorded("no_such_tool", False) == 0
    assert _tool_calls_recorded("finish", True) == _tool_calls_recorded("finish", False) == 0
    body = metrics.render().decode()
    assert 'raas_tool_latency_seconds_bucket{le="+Inf",ok="true",tool="bash"}' in body
