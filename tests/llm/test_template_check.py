"""check_template on real chat templates: equality where the template is append-only, detected drift
where it is not (Qwen3 drops past <think>), and the CLI's exit codes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from raas.cli import app
from raas.llm.template_check import SAMPLE_TOOLS, check_template, sample_conversation
from raas.llm.tokenizer import ChatTokenizer

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("server_returns_stop", [True, False])
def test_smollm2_chatml_is_append_only(smol: ChatTokenizer, server_returns_stop: bool) -> None:
    report = check_template(smol, server_returns_stop_token=server_returns_stop)
    assert report.ok, report.summary()
    assert report.steps == 6 and report.stop_token_ids == [2] and report.closing == "<|im_end|>\n"


@pytest.mark.parametrize(("name", "kwargs"), [("qwen2_5", {}), ("llama3", {"date_string": "26 Jul 2024"})])
@pytest.mark.parametrize("server_returns_stop", [True, False])
def test_fixture_templates_are_append_only(
    fixture_dir: Callable[[str], Path], name: str, kwargs: dict[str, str], server_returns_stop: bool
) -> None:
    tok = ChatTokenizer.from_pretrained(fixture_dir(name))
    report = check_template(tok, server_returns_stop_token=server_returns_stop, **kwargs)
    assert report.ok, report.summary()


def test_qwen3_drift_is_detected_and_append_only_ids_are_kept(fixture_dir: Callable[[str], Path]) -> None:
    tok = ChatTokenizer.from_pretrained(fixture_dir("qwen3"))
    report = check_template(tok)
    assert not report.ok
    # drift appears exactly when a new user query makes the earlier <think> "past"
    assert [m.after for m in report.mismatches] == ["user message after turn 2", "assistant turn 3"]
    first = report.mismatches[0]
    assert "<think>" in first.incremental_text and "<think>" not in first.full_text
    assert first.incremental_len > first.full_len

    # What the trainer receives is the append-only trajectory: every prompt extends the previous one
    # and keeps the reasoning the policy actually sampled.
    first_msgs, later, texts = sample_conversation(thinking=True)
    conv = tok.conversation(first_msgs, tools=SAMPLE_TOOLS)
    prompts = [list(conv.prompt_ids)]
    sampled: list[list[int]] = []
    for turn, text in enumerate(texts[:2]):
        out = tok.encode(text) + tok.encode("<|im_end|>")
        sampled.append(out)
        conv.add_assistant(out)
        conv.add_messages(later[turn])
        prompts.append(list(conv.prompt_ids))
    for t in range(2):
        assert prompts[t + 1][: len(prompts[t]) + len(sampled[t])] == prompts[t] + sampled[t]
    assert tok.decode(conv.ids).count("<think>") == 2
    full = tok.apply_chat_template(conv.messages, tools=SAMPLE_TOOLS, add_generation_prompt=True)
    assert tok.decode(full).count("<think>") == 0


def test_cli_reports_ok_and_drift(smol_dir: Path, fixture_dir: Callable[[str], Path], tmp_path: Path) -> None:
    runner = CliRunner()
    ok = runner.invoke(app, ["tokenizer", "check", str(smol_dir)])
    assert ok.exit_code == 0 and ok.output.startswith("OK")
    drift = runner.invoke(app, ["tokenizer", "check", str(fixture_dir("qwen3"))])
    assert drift.exit_code == 1 and "DRIFT at 2 of 6 steps" in drift.output
    as_json = runner.invoke(app, ["tokenizer", "check", "--json", str(fixture_dir("qwen3"))])
    assert '"ok": false' in as_json.output
    bad = runner.invoke(app, ["tokenizer", "check", str(tmp_path)])
    assert bad.exit_code == 2 and "bad_request" in bad.output
