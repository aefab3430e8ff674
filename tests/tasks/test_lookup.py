"""The ``lookup`` task: its dataset and splits, the grader, and the handler with a scripted policy in real
sandboxes (local and bwrap) — reading the secret with bash and repeating it scores 1, anything else 0."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from tests.agent.scripted import scripted_policy, tool_call

from raas.agent.config import AgentConfig
from raas.agent.toolcalls import parse_tool_calls
from raas.core.jobs import JobResult
from raas.core.trajectory import Message, ToolCall
from raas.errors import RaasError
from raas.llm.tokenizer import ChatTokenizer
from raas.sandbox import SandboxConfig, SandboxManager
from raas.tasks.base import Job, JobSandboxes
from raas.tasks.datasets import load_dataset
from raas.tasks.lookup import (
    EXAMPLE_SECRETS,
    EXAMPLES,
    FILES,
    PROMPT_MESSAGES,
    LookupHandler,
    builtin_lookup,
    grade,
    lookup_details,
    reply_text,
    user_prompt,
)
from raas.tasks.registry import HandlerRegistry

INSTANCE = {"data_source": "lookup", "instance_id": "l1", "file": "secret.txt", "answer": "4821"}


def _conversation(*, call: bool, reply: str, observation: str = "4821\n[exit code 0]") -> list[Message]:
    """A rollout's own messages (after the prompt), as :func:`grade` takes them."""
    msgs: list[Message] = []
    if call:
        text = tool_call("bash", command="cat secret.txt")
        calls = [ToolCall(id="call_0", name="bash", arguments={"command": "cat secret.txt"})]
        msgs.append(Message(role="assistant", content=text, tool_calls=calls))
        msgs.append(Message(role="tool", content=observation, tool_call_id="call_0", name="bash"))
    msgs.append(Message(role="assistant", content=reply))
    return msgs


@pytest.mark.unit
def test_dataset_is_deterministic_and_its_splits_are_disjoint() -> None:
    train, test = builtin_lookup(500), builtin_lookup(500, split="test")
    assert train == builtin_lookup(500) and builtin_lookup(20) == train[:20]  # deterministic, prefix-stable
    assert load_dataset("builtin:lookup") == train[:16] == load_dataset("builtin:lookup:train")
    assert load_dataset("builtin:lookup:7") == train[:7] == load_dataset("builtin:lookup:train:7")
    assert load_dataset("builtin:lookup:test:5") == test[:5]
    assert not {x["instance_id"] for x in train} & {x["instance_id"] for x in test}
    assert not set(FILES["train"]) & set(FILES["test"])
    assert not set(EXAMPLE_SECRETS) & (set(FILES["train"]) | set(FILES["test"]))
    assert {x["file"] for x in train} == set(FILES["train"]) and {x["file"] for x in test} == set(
        FILES["test"]
    )
    # a test prompt is never a train prompt
    assert not {user_prompt(x) for x in train} & {user_prompt(x) for x in test}
    for x in train + test:
        assert x["data_source"] == "lookup" and 1000 <= int(x["answer"]) <= 9999
    assert len({x["answer"] for x in train}) > 400  # secrets vary from instance to instance
    for bad in ("builtin:lookup:0", "builtin:lookup:dev", "builtin:lookup:test:x", "builtin:lookup:test:0"):
        with pytest.raises(RaasError) as e:
            load_dataset(bad)
        assert e.value.kind == "bad_request"
    with pytest.raises(RaasError):
        load_dataset("builtin:math:test")  # only built-ins with splits take one


@pytest.mark.unit
def test_the_secret_is_never_in_the_prompt() -> None:
    examples = "\n".join(m.content for m in EXAMPLES)
    for x in builtin_lookup(2000) + builtin_lookup(2000, split="test"):
        prompt = user_prompt(x)
        assert x["answer"] not in prompt and x["file"] in prompt
        assert x["answer"] not in examples and x["file"] not in examples
    # the examples demonstrate the call and the reply, with secrets of their own
    assert [m.role for m in EXAMPLES] == ["user", "assistant", "tool", "assistant"] * len(EXAMPLE_SECRETS)
    for i, (file, secret) in enumerate(EXAMPLE_SECRETS.items()):
        call = parse_tool_calls(EXAMPLES[4 * i + 1].content, ["bash"])
        assert [(c.name, c.arguments) for c in call.calls] == [("bash", {"command": f"cat {file}"})]
        assert EXAMPLES[4 * i + 2].content.startswith(secret) and EXAMPLES[4 * i + 3].content == secret


@pytest.mark.unit
def test_validate_instance() -> None:
    h = HandlerRegistry().get("lookup")
    assert isinstance(h, LookupHandler)
    h.validate_instance(INSTANCE)
    for bad in (
        {"file": "secret.txt"},
        {"file": "secret.txt", "answer": 4821},
        {"file": "secret.txt", "answer": "48x1"},
        {"file": "../etc/passwd", "answer": "1"},
        {"file": "a/b.txt", "answer": "1"},
        {"file": ".hidden", "answer": "1"},
        {"answer": "1"},
    ):
        with pytest.raises(RaasError) as e:
            h.validate_instance({"data_source": "lookup", **bad})
        assert e.value.kind == "bad_request"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("call", "reply", "reward", "answer"),
    [
        (True, "4821", 1.0, "4821"),
        (True, "The secret number is 4,821.", 1.0, "4821"),
        (True, "1234", 0.0, "1234"),
        (True, "The file says 4821 and the exit code is 0", 0.0, "0"),  # the *last* number counts
        (False, "4821", 1.0, "4821"),  # graded on the answer alone: a lucky guess counts
        (False, "I cannot read files.", 0.0, None),
        # a rollout that ends on a tool call has no answer, whatever the call's text holds
        (True, tool_call("bash", command="echo 4821"), 0.0, None),
    ],
)
def test_grade(call: bool, reply: str, reward: float, answer: str | None) -> None:
    msgs = _conversation(call=call, reply=reply)
    if reply.startswith("<tool_call>"):
        msgs[-1].tool_calls = [ToolCall(id="call_1", name="bash", arguments={"command": "echo 4821"})]
    got, details = grade(msgs, "4821")
    assert got == reward and details.answer == answer
    assert details.tool_called is call and details.secret_seen is call
    assert details.bash_calls == int(call) + int(reply.startswith("<tool_call>"))


@pytest.mark.unit
def test_reply_text_drops_call_markup() -> None:
    text = "I will read it. " + tool_call("bash", command="cat pin.txt")
    assert reply_text(Message(role="assistant", content=text)).strip() == "I will read it."
    bare_json = '{"name": "bash", "arguments": {"command": "cat 12.txt"}}'
    calls = [ToolCall(id="c", name="bash", arguments={"command": "cat 12.txt"})]
    assert reply_text(Message(role="assistant", content=bare_json, tool_calls=calls)) == ""
    assert reply_text(Message(role="assistant", content="7")) == "7"


@pytest.mark.unit
def test_lookup_details_from_a_job_result() -> None:
    _, details = grade(_conversation(call=True, reply="4821"), "4821")
    result = JobResult.model_validate_json(
        JobResult(
            job_id="j", status="completed", reward=1.0, artifacts={"eval_details": details.model_dump()}
        ).model_dump_json()
    )
    assert lookup_details(result) == details
    assert lookup_details(JobResult(job_id="j", status="failed")) is None


# -- the handler in real sandboxes, with a scripted policy --------------------------------------------------


@pytest.fixture(params=["local", "bwrap"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def job_sandboxes(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig
) -> AsyncIterator[JobSandboxes]:
    js = JobSandboxes(sandbox_manager, sandbox_config, owner="lookup-job")
    try:
        yield js
    finally:
        await js.close_all()


@pytest.mark.integration
@pytest.mark.parametrize(
    ("texts", "reward", "called"),
    [
        ([tool_call("bash", command="cat secret.txt"), "4821"], 1.0, True),
        ([tool_call("bash", command="cat secret.txt"), "It is 1234."], 0.0, True),
        ([tool_call("bash", command="ls"), "secret.txt"], 0.0, True),
        (["4821"], 1.0, False),
        (["I do not know."], 0.0, False),
    ],
)
async def test_handler_with_a_scripted_policy(
    tokenizer: ChatTokenizer, job_sandboxes: JobSandboxes, texts: list[str], reward: float, called: bool
) -> None:
    handler = LookupHandler()
    job = Job(job_id="lookup-job", instance=INSTANCE, trajectory_id="t")
    env = await handler.init(job, job_sandboxes)
    async with scripted_policy(tokenizer, texts, AgentConfig(max_turns=8, max_tokens_per_turn=512)) as (
        server,
        llm,
        _,
    ):
        out = await handler.run(job, env, llm)
    await job_sandboxes.close_all()
    env.run_output = out
    result = await handler.eval(job, env)
    assert result.reward == reward and result.resolved is (reward == 1.0)
    details = result.details
    assert details["tool_called"] is called and details["ground_truth"] == "4821"
    # the task's own limits apply (3 turns, 96 tokens) unless the job sets its own
    assert all(r.max_tokens == 96 for r in server.requests) and len(out.turns) == len(texts)
    assert out.finish_reason == "no_tool_call"
    prompt = tokenizer.decode(list(server.requests[0].prompt_ids))
    assert "secret.txt" in prompt and "4821" not in prompt and "cat data.txt" in prompt  # examples shown
    assert (
        out.messages[1 : PROMPT_MESSAGES - 1] == EXAMPLES and out.messages[PROMPT_MESSAGES - 1].role == "user"
    )
    observations = [m.content for m in out.messages[PROMPT_MESSAGES:] if m.role == "tool"]
    assert details["secret_seen"] is any("4821" in o for o in observations)
    if "cat secret.txt" in texts[0]:
        assert observations == ["4821\n[exit code 0]"]
        # the observation is in the record as prompt tokens: loss mask 0
        traj = out.token_trajectory
        delta = out.turns[1].prompt_ids
        start = len(out.turns[0].output_ids)
        assert traj.response_ids[start : start + len(delta)] == delta
        assert traj.loss_mask[start : start + len(delta)] == [0] * len(delta)
        assert "4821" in tokenizer.decode(delta)
