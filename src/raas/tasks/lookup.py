"""The ``lookup`` task: read a secret number out of a file in the sandbox with the bash tool, then say it.

Why: a task whose reward is reachable only through a tool call, so that calling the tool is what a policy
learns through RL. INIT writes a random 4-digit secret into a file in the sandbox's working directory;
the question names the file and the command that reads it, never the secret, which differs per instance.
Two scripted exchanges before it (:data:`EXAMPLES`, other files and secrets) demonstrate the call, in the
Hermes ``<tool_call>`` format the agent loop parses, and the reply: the embedded SmolLM2-135M almost never
makes a call it is only told about, but copies a demonstrated one often enough for RL (measured in
``bench/lookup_task.py``). The reply that ends the rollout is graded on its last number: 1.0 when it equals
the secret, else 0.0. A guess is right about once in 9000 tries, so in practice the reward means "called
the tool correctly and repeated what it returned".

Instances: ``{"data_source": "lookup", "file": "secret.txt", "answer": "4821"}``; ``builtin:lookup``
(:func:`builtin_lookup`) generates them, with train and test splits whose instances, secrets' seeds and
file names are disjoint. Each result's ``eval_details`` say whether the policy called the tool
(:class:`LookupDetails`; :func:`lookup_details` reads them back from a ``JobResult``).
"""

from __future__ import annotations

import random
import re
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel

from raas.agent.config import agent_overrides
from raas.agent.loop import run_agent
from raas.agent.tools import ToolSet
from raas.core.trajectory import EvalOutput, Message, RunOutput
from raas.errors import RaasError
from raas.tasks.base import Env, Job, JobSandboxes, LLMContext, TaskHandler
from raas.tasks.code.handler import sandbox_workdir
from raas.tasks.final_number import final_number

if TYPE_CHECKING:
    from raas.core.jobs import JobResult

SYSTEM_PROMPT = "You are a helpful assistant."
USER_PROMPT = "What is the secret number in {file}? Read it with cat {file}."
"""The question (``{file}`` is the instance's file name); it names the file, never the secret."""
CALL = '<tool_call>\n{{"name": "bash", "arguments": {{"command": "cat {file}"}}}}\n</tool_call>'
"""The call that reads the file, in the Hermes format the agent loop parses."""
EXAMPLE_SECRETS: dict[str, str] = {"data.txt": "5912", "info.txt": "1377"}
"""The demonstrated exchanges' files and secrets: in no split (no instance uses these files or secrets)."""


def _example(file: str, secret: str) -> list[Message]:
    return [
        Message(role="user", content=USER_PROMPT.format(file=file)),
        Message(role="assistant", content=CALL.format(file=file)),
        Message(role="tool", content=f"{secret}\n[exit code 0]", name="bash"),
        Message(role="assistant", content=secret),
    ]


EXAMPLES: list[Message] = [m for file, secret in EXAMPLE_SECRETS.items() for m in _example(file, secret)]
"""Two demonstrated exchanges before the question: SmolLM2-135M (the embedded model) almost never makes a
tool call it is only told about, but copies a demonstrated one (``bench/lookup_task.py``)."""
PROMPT_MESSAGES = 2 + len(EXAMPLES)
"""A rollout's messages start with the system message, the examples and the question."""

TOOLS = ("bash",)
MAX_TURNS = 3
"""A call, the answer, and one more try after a malformed call."""
MAX_TOKENS_PER_TURN = 96
"""A tool call or a short answer fits; a rambling turn is cut (and scores 0 unless it ends a rollout with
the number). Both apply unless the job's ``sampling_params`` set ``max_turns`` / ``max_tokens_per_turn``."""

Split = Literal["train", "test"]
SPLITS: tuple[Split, ...] = ("train", "test")
FILES: dict[Split, tuple[str, ...]] = {
    "train": ("secret.txt", "answer.txt", "number.txt", "code.txt", "key.txt", "pin.txt", "value.txt"),
    "test": ("token.txt", "result.txt", "magic.txt", "hidden.txt"),
}
"""File names per split, disjoint: a test prompt is never a train prompt, so a policy that learned to type
``cat secret.txt`` whatever it is asked does not pass the test split."""
BUILTIN_LOOKUP_DEFAULT_N = 16
BUILTIN_LOOKUP_MAX_N = 10_000

_FILE_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}$")
_SECRET = re.compile(r"^[0-9]{1,12}$")
_CALL_MARKUP = re.compile(r"<tool_call>.*?(?:</tool_call>|$)|<function=[^>\s]+>.*?</function>", re.DOTALL)


def lookup_instance(split: Split, index: int) -> dict[str, Any]:
    """Instance ``index`` of ``split``: a file name of the split and a secret in 1000..9999, both drawn
    from a generator seeded by the split and the index (deterministic; string seeds hash with SHA-512)."""
    r = random.Random(f"raas-lookup-{split}-{index}")
    return {
        "instance_id": f"builtin-lookup-{split}-{index:04d}",
        "data_source": "lookup",
        "file": r.choice(FILES[split]),
        "answer": _secret(r),
    }


def _secret(r: random.Random) -> str:
    """A secret in 1000..9999 that is not one of the examples' (those are in every prompt)."""
    while (secret := str(r.randint(1000, 9999))) in EXAMPLE_SECRETS.values():
        pass
    return secret


def builtin_lookup(n: int | None = None, *, split: str = "train") -> list[dict[str, Any]]:
    """The first ``n`` (default 16) instances of ``split`` (prefix-stable: a small set is part of a big one)."""
    if split not in SPLITS:
        raise RaasError(f"builtin:lookup split must be train or test, got {split!r}", kind="bad_request")
    n = BUILTIN_LOOKUP_DEFAULT_N if n is None else n
    if not 1 <= n <= BUILTIN_LOOKUP_MAX_N:
        raise RaasError(
            f"builtin:lookup size must be in 1..{BUILTIN_LOOKUP_MAX_N}, got {n}", kind="bad_request"
        )
    return [lookup_instance(split, i) for i in range(n)]


def user_prompt(instance: dict[str, Any]) -> str:
    """The user message of ``instance`` (names the file, never the secret)."""
    return USER_PROMPT.format(file=instance["file"])


def reply_text(msg: Message) -> str:
    """The prose of an assistant message, without its tool-call markup (a bare JSON call is all markup)."""
    text = _CALL_MARKUP.sub("", msg.content)
    if msg.tool_calls and text == msg.content:
        return ""
    return text


class LookupDetails(BaseModel):
    """What EVAL records per rollout (``JobResult.artifacts["eval_details"]``)."""

    tool_called: bool
    """The policy made at least one well-formed ``bash`` call (run in the sandbox, its output shown)."""
    bash_calls: int
    secret_seen: bool
    """A tool observation the policy read holds the secret: the call did read the file."""
    answer: str | None
    """The last number of the final reply (None: no number, or the rollout ended on a tool call)."""
    ground_truth: str


def lookup_details(result: JobResult) -> LookupDetails | None:
    """The :class:`LookupDetails` of a ``lookup`` job's result (None when it has none: a failed job)."""
    details = result.artifacts.get("eval_details")
    return LookupDetails.model_validate(details) if isinstance(details, dict) else None


def grade(messages: list[Message], truth: str) -> tuple[float, LookupDetails]:
    """1.0 when the final assistant reply's last number equals ``truth``, else 0.0; graded on the answer
    alone (a tool call is how to learn the secret, not a condition of the reward). ``messages`` are the
    rollout's own, after the prompt (``RunOutput.messages[PROMPT_MESSAGES:]``)."""
    replies = [m for m in messages if m.role == "assistant"]
    calls = [c for m in replies for c in (m.tool_calls or []) if c.name == "bash"]
    seen = any(m.role == "tool" and m.name == "bash" and truth in m.content for m in messages)
    answer = final_number(reply_text(replies[-1])) if replies else None
    ok = answer is not None and answer == truth
    details = LookupDetails(
        tool_called=bool(calls), bash_calls=len(calls), secret_seen=seen, answer=answer, ground_truth=truth
    )
    return (1.0 if ok else 0.0), details


class LookupHandler(TaskHandler):
    """Read the secret with the bash tool and reply with it (see the module docstring)."""

    name: ClassVar[str] = "lookup"
    needs_tokenizer: ClassVar[bool] = True

    def validate_instance(self, instance: dict[str, Any]) -> None:
        file, answer = instance.get("file"), instance.get("answer")
        if not isinstance(file, str) or not _FILE_NAME.match(file):
            raise RaasError(
                "lookup instance needs 'file': a plain file name (letters, digits, '_', '-', '.')",
                kind="bad_request",
            )
        if not isinstance(answer, str) or not _SECRET.match(answer):
            raise RaasError("lookup instance needs 'answer': a string of 1-12 digits", kind="bad_request")

    async def init(self, job: Job, sandboxes: JobSandboxes) -> Env:
        self.validate_instance(job.instance)
        if job.external_rollout:  # its agent runs outside raas: no sandbox for it (EVAL opens its own)
            return Env(job=job, sandboxes=sandboxes)
        sandbox = await sandboxes.open()
        path = f"{sandbox_workdir(sandbox).rstrip('/')}/{job.instance['file']}"
        await sandbox.tools.write_file(path, f"{job.instance['answer']}\n")
        return Env(job=job, sandboxes=sandboxes, sandbox=sandbox)

    async def run(self, job: Job, env: Env, llm: LLMContext) -> RunOutput:
        if env.sandbox is None:
            raise RaasError("lookup run stage has no sandbox", kind="handler_error", stage="run")
        chosen = agent_overrides(job.sampling_params)
        defaults: dict[str, Any] = {
            "max_turns": MAX_TURNS,
            "max_tokens_per_turn": min(llm.agent.max_tokens_per_turn, MAX_TOKENS_PER_TURN),
            "stop_on_no_tool_call": True,  # the reply without a call is the answer
        }
        agent = llm.agent.model_copy(update={k: v for k, v in defaults.items() if k not in chosen})
        out = await run_agent(
            job,
            env.sandbox,
            llm,
            ToolSet(TOOLS),
            agent,
            system_prompt=agent.system_prompt or SYSTEM_PROMPT,
            user_prompt=user_prompt(job.instance),
            examples=EXAMPLES,
        )
        replies = [m for m in out.messages[PROMPT_MESSAGES:] if m.role == "assistant"]
        out.answer = final_number(reply_text(replies[-1])) if replies else None
        return out

    async def eval(self, job: Job, env: Env) -> EvalOutput:
        run = env.run_output
        if run is None:
            raise RaasError("lookup eval stage has no run output", kind="handler_error", stage="eval")
        reward, details = grade(run.messages[PROMPT_MESSAGES:], str(job.instance["answer"]))
        return EvalOutput(reward=reward, resolved=reward == 1.0, details=details.model_dump())
