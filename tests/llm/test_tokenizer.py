"""Append-only chat templating on the real SmolLM2 tokenizer and on fixture templates."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from raas.errors import RaasError
from raas.llm.template_check import SAMPLE_TOOLS, check_template
from raas.llm.tokenizer import ChatTokenizer

pytestmark = pytest.mark.unit

SYSTEM_USER = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List files."}]


def test_first_prompt_is_the_full_render(smol: ChatTokenizer) -> None:
    conv = smol.conversation(SYSTEM_USER)
    text = smol.decode(conv.prompt_ids)
    assert text == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nList files.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert conv.prompt_ids == smol.apply_chat_template(SYSTEM_USER, add_generation_prompt=True)
    assert set(conv.mask) == {0}


@pytest.mark.parametrize("server_returns_stop", [True, False])
def test_turn_appends_sampled_ids_then_template_closing(
    smol: ChatTokenizer, server_returns_stop: bool
) -> None:
    conv = smol.conversation(SYSTEM_USER)
    p0 = list(conv.prompt_ids)
    sampled = smol.encode("ls -la") + ([2] if server_returns_stop else [])
    logprobs = [-0.5] * len(sampled)
    msg = conv.add_assistant(sampled, logprobs)
    assert msg == {"role": "assistant", "content": "ls -la"}
    # the sampled IDs are kept exactly; the template's closing is appended with mask 0
    assert conv.ids[: len(p0) + len(sampled)] == p0 + sampled
    closing = conv.ids[len(p0) + len(sampled) :]
    assert smol.decode(closing) == ("\n" if server_returns_stop else "<|im_end|>\n")
    assert conv.mask == [0] * len(p0) + [1] * len(sampled) + [0] * len(closing)
    assert conv.logprobs[len(p0) : len(p0) + len(sampled)] == logprobs
    assert all(lp is None for lp in conv.logprobs[len(p0) + len(sampled) :])
    delta = conv.add_messages([{"role": "tool", "content": "a.py"}])
    assert smol.decode(delta) == "<|im_start|>tool\na.py<|im_end|>\n<|im_start|>assistant\n"
    assert conv.ids == smol.apply_chat_template(conv.messages, add_generation_prompt=True)


def test_both_server_behaviours_give_identical_ids(smol: ChatTokenizer) -> None:
    runs = []
    for with_stop in (True, False):
        conv = smol.conversation(SYSTEM_USER)
        conv.add_assistant(smol.encode("ok") + ([2] if with_stop else []))
        conv.add_messages([{"role": "user", "content": "again"}])
        runs.append(conv.ids)
    assert runs[0] == runs[1]


def test_length_cut_output_is_closed_by_the_template(smol: ChatTokenizer) -> None:
    conv = smol.conversation(SYSTEM_USER)
    conv.add_assistant(smol.encode("I will now"))  # hit max_tokens: no stop token
    assert smol.decode(conv.ids).endswith("I will now<|im_end|>\n")


def test_turn_cost_does_not_grow_with_history(smol: ChatTokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each new turn renders only a fixed dummy prefix plus the new messages, never the history."""
    conv = smol.conversation(SYSTEM_USER)
    rendered: list[int] = []
    original = smol.render

    def spy(messages: Any, **kw: Any) -> str:
        rendered.append(len(messages))
        return original(messages, **kw)

    monkeypatch.setattr(smol, "render", spy)
    for turn in range(30):
        conv.add_assistant([*smol.encode(f"step {turn}"), 2])
        conv.add_messages([{"role": "tool", "content": f"out {turn}"}])
    assert max(rendered) <= 4  # dummy system + user + last message + one new message
    monkeypatch.undo()
    assert conv.ids == smol.apply_chat_template(conv.messages, add_generation_prompt=True)


def test_tools_are_injected_when_the_template_cannot_render_them(smol: ChatTokenizer) -> None:
    assert not smol.supports_tools
    conv = smol.conversation(SYSTEM_USER, tools=SAMPLE_TOOLS)
    text = smol.decode(conv.prompt_ids)
    assert text.startswith("<|im_start|>system\nYou are terse.\n\n# Tools")
    assert json.dumps(SAMPLE_TOOLS[0]) in text and "<tool_call>" in text


def test_fixture_template_renders_tools_itself(fixture_dir: Callable[[str], Path]) -> None:
    qwen = ChatTokenizer.from_pretrained(fixture_dir("qwen2_5"))
    assert qwen.supports_tools
    text = qwen.render(SYSTEM_USER, tools=SAMPLE_TOOLS, add_generation_prompt=True)
    assert text.startswith(
        "<|im_start|>system\nYou are terse.\n\n# Tools\n\nYou may call one or more functions"
    )


@pytest.mark.parametrize("name", ["qwen2_5", "qwen3", "llama3"])
def test_render_matches_transformers(fixture_dir: Callable[[str], Path], name: str) -> None:
    """raas renders templates without transformers; it must agree with transformers' own render."""
    transformers = pytest.importorskip("transformers")
    path = fixture_dir(name)
    ours = ChatTokenizer.from_pretrained(path)
    theirs = transformers.PreTrainedTokenizerFast.from_pretrained(str(path))
    msgs = [*SYSTEM_USER, {"role": "assistant", "content": "ok"}, {"role": "tool", "content": "x"}]
    kwargs = {"date_string": "26 Jul 2024"}
    expected = theirs.apply_chat_template(
        msgs, tools=SAMPLE_TOOLS, tokenize=False, add_generation_prompt=True, **kwargs
    )
    assert ours.render(msgs, tools=SAMPLE_TOOLS, add_generation_prompt=True, **kwargs) == expected
    assert ours.encode(expected) == theirs.encode(expected, add_special_tokens=False)


def test_grouped_tool_results_in_separate_calls_stay_append_only(fixture_dir: Callable[[str], Path]) -> None:
    """Qwen groups consecutive tool results in one block; adding them one call at a time cannot be
    append-only for the full render, so the conversation notes it and keeps appending."""
    tok = ChatTokenizer.from_pretrained(fixture_dir("qwen2_5"))
    conv = tok.conversation(SYSTEM_USER)
    conv.add_assistant(tok.encode("calling") + tok.encode("<|im_end|>"))
    conv.add_messages([{"role": "tool", "content": "one"}], add_generation_prompt=False)
    before = list(conv.ids)
    conv.add_messages([{"role": "tool", "content": "two"}])
    assert conv.ids[: len(before)] == before
    assert conv.notes and "re-renders the previous 'tool'" in conv.notes[0]
    together = tok.conversation(SYSTEM_USER)
    together.add_assistant(tok.encode("calling") + tok.encode("<|im_end|>"))
    together.add_messages([{"role": "tool", "content": "one"}, {"role": "tool", "content": "two"}])
    assert together.ids == tok.apply_chat_template(together.messages, add_generation_prompt=True)
    assert not together.notes


@pytest.mark.parametrize(
    "messages",
    [[{"content": "no role"}], ["not a dict"], [{"role": "user", "content": 5}]],
)
def test_bad_messages_are_bad_requests(smol: ChatTokenizer, messages: list[Any]) -> None:
    with pytest.raises(RaasError) as err:
        smol.conversation(messages)
    assert err.value.kind == "bad_request"
    conv = smol.conversation(SYSTEM_USER)
    with pytest.raises(RaasError) as err:
        conv.add_messages(messages)
    assert err.value.kind == "bad_request"


def test_logprob_count_mismatch_is_typed(smol: ChatTokenizer) -> None:
    conv = smol.conversation(SYSTEM_USER)
    with pytest.raises(RaasError) as err:
        conv.add_assistant([1, 2, 3], [0.0])
    assert err.value.kind == "llm_error"


def test_loading_errors_are_typed(tmp_path: Path, smol_dir: Path) -> None:
    with pytest.raises(RaasError) as err:
        ChatTokenizer.from_pretrained(tmp_path)
    assert err.value.kind == "bad_request"
    (tmp_path / "tokenizer.json").write_text((smol_dir / "tokenizer.json").read_text())
    with pytest.raises(RaasError, match="no chat template"):
        ChatTokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}"}))
    with pytest.raises(RaasError, match="does not compile"):
        ChatTokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "{{ raise_exception('no') }}"})
    )
    tok = ChatTokenizer.from_pretrained(tmp_path)
    with pytest.raises(RaasError, match="chat template failed: no"):
        tok.conversation(SYSTEM_USER)


@pytest.mark.parametrize("template_file", ["tokenizer_config.json", "chat_template.jinja"])
def test_prepare_from_a_plain_hf_model_dir(smol_dir: Path, tmp_path: Path, template_file: str) -> None:
    """``raas llm prepare DIR`` takes a Hugging Face dir whose template sits in either place."""
    from raas.llm.models import prepare_tokenizer

    src = tmp_path / "Qwen-ish"
    src.mkdir()
    (src / "tokenizer.json").write_text((smol_dir / "tokenizer.json").read_text())
    template = (Path(__file__).parent / "fixtures" / "qwen2_5.jinja").read_text()
    config: dict[str, Any] = {"eos_token": "<|im_end|>"}
    if template_file == "chat_template.jinja":
        (src / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    out = prepare_tokenizer(src, tmp_path / "prepared" / "tokenizer")
    tok = ChatTokenizer.from_pretrained(out)
    assert tok.name == "prepared" and tok.chat_template == template and tok.eos_token_ids == [2]
    assert prepare_tokenizer(src, out) == out  # cached: a second call is a no-op
    with pytest.raises(RaasError) as err:
        prepare_tokenizer(tmp_path / "missing", tmp_path / "x")
    assert err.value.kind == "bad_request"
    (src / "tokenizer_config.json").write_text("{}")
    (src / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(RaasError, match="no chat template"):
        prepare_tokenizer(src, tmp_path / "y", force=True)


def test_generation_blocks_of_training_templates_render_their_body(smol_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text((smol_dir / "tokenizer.json").read_text())
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
        "{{ m.content }}<|im_end|>\n{% endgeneration %}{% else %}{{ m.content }}<|im_end|>\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": template, "eos_token": "<|im_end|>"})
    )
    tok = ChatTokenizer.from_pretrained(tmp_path)
    text = tok.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    assert check_template(tok).ok
