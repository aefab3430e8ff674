"""The scripted teacher of swe-mini warm starts, as the agent loop meets it: it finds its instance from the
issue in a prompt the scaffold renders (not from the demonstrated issue before it) and answers each turn
with the next call of the gold fix, in the policy tokenizer's own tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from raas.agent.loop import _as_chat, _parse
from raas.llm.models import prepare_tokenizer
from raas.llm.scripted import CompletionRequest
from raas.llm.tokenizer import ChatTokenizer
from raas.tasks.swe.mini.handler import EXAMPLE, PROMPT_TEMPLATE, SYSTEM_PROMPT
from raas.tasks.swe.mini.teacher import TeacherBook, script_for

pytestmark = pytest.mark.unit

BUGGY = "def clamp(x, lo, hi):\n    if x > hi:\n        return lo\n    return x\n"
PATCH = (
    "diff --git a/clamp.py b/clamp.py\n--- a/clamp.py\n+++ b/clamp.py\n@@ -1,4 +1,4 @@\n"
    " def clamp(x, lo, hi):\n     if x > hi:\n-        return lo\n+        return hi\n     return x\n"
)


def record(tmp_path: Path, level: str = "function") -> dict[str, object]:
    (tmp_path / "testbed").mkdir(exist_ok=True)
    (tmp_path / "testbed/clamp.py").write_text(BUGGY)
    return {
        "instance_id": f"swe-mini__{level}-x-clamp-1",
        "problem_statement": f"Bug in `clamp` (file `clamp.py`) [{level}]\n",
        "patch": PATCH,
        "image": str(tmp_path),
        "level": level,
        "function": "clamp",
    }


def test_the_script_is_view_replace_submit_and_search_first_on_the_report_rung(tmp_path: Path) -> None:
    calls = [_parse(t)[0][0] for t in script_for(record(tmp_path)) or []]
    assert [c.name for c in calls][:2] == ["view", "replace"] and calls[-1].name == "submit"
    assert calls[0].arguments == {"path": "clamp.py"}
    assert calls[1].arguments == {"path": "clamp.py", "old": "return lo", "new": "return hi"}
    report = [_parse(t)[0][0].name for t in script_for(record(tmp_path, "report")) or []]
    assert report[:3] == ["search", "view", "replace"]


def test_the_teacher_answers_the_issue_in_the_prompt_turn_by_turn(tmp_path: Path) -> None:
    tok = ChatTokenizer.from_pretrained(prepare_tokenizer())
    book = TeacherBook(tok)
    rec = record(tmp_path)
    other = {**record(tmp_path), "instance_id": "other", "problem_statement": "Bug in `other`\n"}
    assert book.add([rec, other]) == [rec, other]
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        *(_as_chat(m) for m in EXAMPLE),
        {"role": "user", "content": PROMPT_TEMPLATE.format(problem_statement=rec["problem_statement"])},
    ]
    conv = tok.conversation(messages, tools=[])
    answers = []
    for turn in range(3):
        c = book(CompletionRequest(list(conv.prompt_ids), None, 128, {}, turn))
        assert c.token_ids[-1] == tok.stop_token_ids()[0]
        answers.append(c.text)
        conv.add_assistant(c.token_ids[:-1], [0.0] * (len(c.token_ids) - 1))
        conv.add_messages([{"role": "tool", "content": "ok", "name": "x"}])
    names = [json.loads(a.split("\n")[1])["name"] for a in answers]
    assert names[:2] == ["view", "replace"] and book.served == 3
    with pytest.raises(RuntimeError, match="no script"):
        unknown = tok.conversation(
            [*messages[:-1], {"role": "user", "content": PROMPT_TEMPLATE.format(problem_statement="nope")}],
            tools=[],
        )
        book(CompletionRequest(list(unknown.prompt_ids), None, 128, {}, 9))
