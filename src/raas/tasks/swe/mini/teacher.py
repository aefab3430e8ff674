"""A scripted teacher for the ``swe-mini`` scaffold: the gold fix typed through the same tools a policy uses.

Why: rejection-sampling fine-tuning needs resolved trajectories, and a 135M base policy resolves almost
none. The teacher is a :class:`~raas.llm.scripted.ScriptedLLM` responder (the vLLM wire protocol) that
answers each turn of each job with the next call of its instance's script: ``search`` for the function
(only on the ``report`` rung, whose issue does not name the file), ``view`` the file, ``replace`` the buggy
text with the fixed text (the smallest unique snippet of the changed line), sometimes ``run_tests``, then
``submit``. The jobs run through the real SWE handler (INIT, the tools in the sandbox, EVAL with the
hidden tests); only trajectories EVAL resolves are kept, and their tokens, observations masked, are what
the policy is fine-tuned on. The prompt is the scaffold's own, unchanged: the teacher finds its instance
from the issue text in the prompt (the last ``Fix this issue:`` block).
"""

from __future__ import annotations

import difflib
import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raas.llm.scripted import Completion, CompletionRequest
from raas.llm.tokenizer import ChatTokenizer
from raas.tasks.swe.replay import SUBMIT, hunks, tool_call

from .handler import PROMPT_TEMPLATE

ISSUE_MARK = PROMPT_TEMPLATE.split("{", 1)[0]
RUN_TESTS_SHARE = 0.25
"""The fraction of scripts that run the visible tests before submitting (chosen per instance, fixed)."""


def gold_edit(buggy: str, fixed: str) -> tuple[str, str] | None:
    """(old, new) for ``replace``: the smallest text of the buggy file that occurs once and covers what the
    fix changes (the changed line stripped, else whole lines with as many lines before as it takes), and
    what it becomes. None when the fix is not one contiguous change."""
    a, b = buggy.split("\n"), fixed.split("\n")
    blocks = [
        op for op in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes() if op[0] != "equal"
    ]
    if len(blocks) != 1 or blocks[0][0] != "replace":
        return None
    _, i1, i2, j1, j2 = blocks[0]
    old_lines, new_lines = a[i1:i2], b[j1:j2]
    if len(old_lines) == 1 and len(new_lines) == 1 and buggy.count(old_lines[0].strip()) == 1:
        return old_lines[0].strip(), new_lines[0].strip()
    for before in range(i1 + 1):
        context = a[i1 - before : i1]
        old = "\n".join([*context, *old_lines])
        if buggy.count(old) == 1:
            return old, "\n".join([*context, *new_lines])
    return None


def script_for(record: dict[str, Any]) -> list[str] | None:
    """The teacher's turns for one ``swe-mini`` record (its image must be on this host), or None when the
    gold patch is not a single contiguous edit of one file."""
    patch_hunks = hunks(str(record["patch"]))
    if len(patch_hunks) != 1:
        return None
    path = patch_hunks[0].path
    buggy_file = Path(str(record["image"]), str(record.get("workdir", "/testbed")).lstrip("/"), path)
    try:
        buggy = buggy_file.read_text(encoding="utf-8")
    except OSError:
        return None
    fixed = buggy.replace(patch_hunks[0].old, patch_hunks[0].new, 1)
    edit = gold_edit(buggy, fixed)
    if edit is None or fixed == buggy:
        return None
    calls: list[str] = []
    if record.get("level") == "report":
        calls.append(tool_call("search", text=f"def {record.get('function')}("))
    calls.append(tool_call("view", path=path))
    calls.append(tool_call("replace", path=path, old=edit[0], new=edit[1]))
    digest = int(hashlib.sha256(str(record["instance_id"]).encode()).hexdigest(), 16)
    if (digest % 1000) / 1000 < RUN_TESTS_SHARE:
        calls.append(tool_call("run_tests"))
    return [*calls, SUBMIT]


@dataclass
class TeacherBook:
    """The responder: scripts by issue text (see the module docstring)."""

    tok: ChatTokenizer
    scripts: dict[str, list[str]] = field(default_factory=dict)
    served: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _header: str = ""
    _eos: int = 0

    def __post_init__(self) -> None:
        user = [{"role": "user", "content": "x"}]
        opened = self.tok.render(user, add_generation_prompt=True)
        self._header = opened[len(self.tok.render(user)) :].strip() or "assistant"
        self._eos = self.tok.stop_token_ids()[0]

    def add(self, records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """Register the scripts of ``records``; returns the records that got one (an issue text seen
        twice keeps its first script: the teacher could not tell the two apart)."""
        kept = []
        for r in records:
            statement = str(r["problem_statement"]).strip()
            script = script_for(r)
            if script is None or statement in self.scripts:
                continue
            self.scripts[statement] = script
            kept.append(r)
        return kept

    def __call__(self, req: CompletionRequest) -> Completion:
        text = self.tok.decode(req.prompt_ids)
        at = text.rfind(ISSUE_MARK)
        if at < 0:
            raise RuntimeError("a prompt without an issue")
        tail = text[at + len(ISSUE_MARK) :]
        statement = tail.split(self._header, 1)[0]
        for stop in self.tok.special_tokens.values():
            statement = statement.split(stop, 1)[0] if stop else statement
        script = self.scripts.get(statement.strip())
        if script is None:
            raise RuntimeError("a prompt whose issue the teacher has no script for")
        turn = tail.count(self._header) - 1
        with self._lock:
            self.served += 1
        answer = script[min(max(turn, 0), len(script) - 1)]
        c = Completion.of_text(answer, encode=self.tok.encode, eos_id=self._eos)
        c.logprobs = [0.0] * len(c.token_ids)
        return c
