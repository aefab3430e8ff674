"""``raas run``'s agent settings per task: SWE jobs get the SWE handler's defaults (sized by measuring its
prompt with the real chat tokenizer) unless the user sets them; math and the other built-ins keep the
generic ones their benchmarks were measured with; ``raas run --help`` shows both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from raas.agent.tools import ToolSet
from raas.cli import app
from raas.cli.run import BASE_AGENT, agent_settings, make_jobs
from raas.core.jobs import JobRequest
from raas.llm.models import default_tokenizer_dir
from raas.llm.tokenizer import ChatTokenizer
from raas.tasks.datasets import load_file
from raas.tasks.swe.config import AGENT_DEFAULTS
from raas.tasks.swe.handler import SweHandler
from raas.tasks.swe.instance import parse_task

pytestmark = pytest.mark.unit

SWE_DATA = Path(__file__).parents[1] / "tasks" / "swe" / "data" / "swebench_records.jsonl"
MATH = {"data_source": "math", "problem": "What is 6 times 7?", "answer": "42", "instance_id": "m"}
NONE_CHOSEN: dict[str, int | None] = {"max_turns": None, "max_tokens_per_turn": None, "context_budget": None}


def test_swe_jobs_get_the_handler_defaults_and_math_jobs_the_generic_ones() -> None:
    swe = load_file(SWE_DATA)[0]
    base, extra = agent_settings([swe, MATH], NONE_CHOSEN)
    assert base == BASE_AGENT == {"max_turns": 4, "max_tokens_per_turn": 256, "context_budget": 2048}
    assert extra == [{"max_turns": 30, "max_tokens_per_turn": 1024, "context_budget": 8192}, {}]
    jobs = make_jobs([swe, MATH], 1, "run-x", {"temperature": 1.0}, None, extra)
    for j in jobs:
        JobRequest.model_validate(j)
    assert jobs[0]["sampling_params"] == {"temperature": 1.0, **AGENT_DEFAULTS}
    assert jobs[1]["sampling_params"] == {"temperature": 1.0}  # the service's (generic) settings apply


def test_what_the_user_sets_wins_for_every_task() -> None:
    swe = load_file(SWE_DATA)[0]
    base, extra = agent_settings([swe, MATH], {**NONE_CHOSEN, "max_turns": 2})
    assert base == {**BASE_AGENT, "max_turns": 2}
    assert extra == [{"max_tokens_per_turn": 1024, "context_budget": 8192}, {}]
    _, extra = agent_settings([swe], {"max_turns": 2, "max_tokens_per_turn": 64, "context_budget": 4096})
    assert extra == [{}]


def test_help_shows_the_generic_and_the_swe_defaults() -> None:
    result = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "Agent turns per rollout (default 4; SWE tasks 30)" in result.output
    assert "Tokens per turn (default 256; SWE tasks 1024)" in result.output
    assert "(default 2048; SWE tasks 8192)" in result.output


def test_the_swe_budget_fits_the_measured_prompt() -> None:
    """The SWE prompt as the agent loop renders it (system prompt, tool schemas, the issue), measured with
    the embedded model's chat tokenizer: the default context leaves room for many full turns."""
    tok = ChatTokenizer.from_pretrained(default_tokenizer_dir())
    handler = SweHandler()
    schemas = ToolSet(handler.settings.tools).schemas

    def prompt_len(row: dict[str, object]) -> int:
        messages = [
            {"role": "system", "content": handler.settings.system_prompt},
            {"role": "user", "content": handler.prompt(parse_task(row))},
        ]
        return len(tok.conversation(messages, tools=schemas).prompt_ids)

    rows = [json.loads(line) for line in SWE_DATA.read_text().splitlines()]
    fixed = prompt_len({**rows[0], "problem_statement": "x"})
    lengths = [prompt_len(r) for r in rows]
    assert 600 <= fixed <= 1200, fixed  # what every SWE prompt costs before the issue
    assert BASE_AGENT["context_budget"] - max(lengths) < 1200  # the generic budget: room for little
    room = AGENT_DEFAULTS["context_budget"] - max(lengths)
    assert room >= 6 * AGENT_DEFAULTS["max_tokens_per_turn"], (lengths, room)
