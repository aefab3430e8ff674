"""The replay policy of SWE tasks: known patches played through the real pipeline, for dry runs and tests.

A replay policy is a :class:`~raas.llm.scripted.ScriptedLLM` (the vLLM wire protocol) whose answers are
Hermes tool calls acting through the real tools: ``git apply`` of the patch in bash (or one editor
``str_replace`` per hunk), then ``submit``. The SWE handler then takes the patch from the RUN sandbox and
grades it in EVAL, as it would a model's. ``raas run DATA --policy replay --patches preds.jsonl`` uses it
to check a dataset end to end (images, INIT, RUN tools, patch extraction, EVAL) without a model; a gold
patch must come out ``resolved``.

One server serves many concurrent jobs: each job's system prompt carries a marker ``[script:KEY]`` (sent
per job as ``sampling_params.system_prompt``), and the responder decodes the prompt, finds the job's
script and answers its next turn (the number of assistant turns already in the prompt).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from raas.llm.scripted import Completion, CompletionRequest
from raas.llm.tokenizer import ChatTokenizer


def tool_call(name: str, **arguments: Any) -> str:
    """An assistant message calling one tool in the Hermes format (``<tool_call>{json}</tool_call>``)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


SYSTEM = "You are a software engineer. Fix the issue, then call submit. [script:{key}]"
_MARKER = re.compile(r"\[script:([A-Za-z0-9_.:-]+)\]")


@dataclass
class Hunk:
    path: str
    old: str
    new: str


def hunks(patch: str) -> list[Hunk]:
    """Each hunk of a unified diff as (file, old text, new text), context included."""
    out: list[Hunk] = []
    path = ""
    old: list[str] | None = None
    new: list[str] = []

    def flush() -> None:
        if old is not None:
            out.append(Hunk(path, "\n".join(old), "\n".join(new)))

    for line in patch.split("\n"):
        if line.startswith("diff --git "):
            flush()
            old = None
        elif line.startswith("+++ "):
            path = line[len("+++ b/") :]
        elif line.startswith("@@"):
            flush()
            old, new = [], []
        elif old is not None and line[:1] in (" ", "-", "+"):
            if line[0] in " -":
                old.append(line[1:])
            if line[0] in " +":
                new.append(line[1:])
    flush()
    return out


def gold_by_editor(patch: str, workdir: str = "/testbed") -> list[str]:
    """Tool calls that type ``patch`` with the editor (one ``str_replace`` per hunk)."""
    return [
        tool_call(
            "str_replace_editor",
            command="str_replace",
            path=f"{workdir}/{h.path}",
            old_str=h.old,
            new_str=h.new,
        )
        for h in hunks(patch)
    ]


def gold_by_bash(patch: str, workdir: str = "/testbed") -> list[str]:
    """One bash call that writes ``patch`` to a file and applies it with ``git apply`` (then, as SWE-bench
    does, ``patch --fuzz``)."""
    end = "RAAS_EOF"
    while end in patch:
        end += "_"
    body = patch if patch.endswith("\n") else patch + "\n"
    command = (
        f"cd {workdir} && cat > /tmp/fix.patch <<'{end}'\n{body}{end}\n"
        "(git apply /tmp/fix.patch || patch --batch --fuzz=5 -p1 -i /tmp/fix.patch) && echo applied"
    )
    return [tool_call("bash", command=command)]


def wrong_edit(path: str, n_lines: int, workdir: str = "/testbed") -> list[str]:
    """An edit that changes the file without fixing anything (a comment at its end)."""
    return [
        tool_call(
            "str_replace_editor",
            command="insert",
            path=f"{workdir}/{path}",
            insert_line=n_lines,
            new_str="# reviewed\n",
        )
    ]


SUBMIT = tool_call("submit")


@dataclass
class ScriptBook:
    """Scripts by key; the responder of a shared scripted server."""

    tok: ChatTokenizer
    scripts: dict[str, list[str]] = field(default_factory=dict)
    served: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _header: str = ""
    _eos: int = 0

    def __post_init__(self) -> None:
        # The text the template opens an assistant turn with (ChatML: "<|im_start|>assistant\n"): a
        # prompt holds one per assistant turn so far, plus the one it ends with.
        user = [{"role": "user", "content": "x"}]
        opened = self.tok.render(user, add_generation_prompt=True)
        self._header = opened[len(self.tok.render(user)) :].strip() or "assistant"
        self._eos = self.tok.stop_token_ids()[0]

    def add(self, key: str, calls: Sequence[str]) -> dict[str, str]:
        """Register a script (its last turn is ``submit``); returns the job's ``sampling_params``."""
        self.scripts[key] = [*calls, SUBMIT]
        return {"system_prompt": SYSTEM.format(key=key)}

    def __call__(self, req: CompletionRequest) -> Completion:
        text = self.tok.decode(req.prompt_ids)
        m = _MARKER.search(text)
        if m is None or m.group(1) not in self.scripts:
            raise RuntimeError("a prompt without a known script marker")
        key = m.group(1)
        turn = text.count(self._header) - 1
        script = self.scripts[key]
        with self._lock:
            self.served[key] = self.served.get(key, 0) + 1
        answer = script[min(turn, len(script) - 1)]
        c = Completion.of_text(answer, encode=self.tok.encode, eos_id=self._eos)
        c.logprobs = [-0.25] * len(c.token_ids)
        return c


REPLAY_CONTEXT = 8192
"""Room a replayed rollout keeps besides its scripted answers: the prompt and the tools' output."""


def replay_book(
    tok: ChatTokenizer, patches: dict[str, str], instances: Sequence[dict[str, Any]]
) -> tuple[ScriptBook, list[dict[str, Any]]]:
    """A book that applies ``patches[instance_id]`` (bash, ``git apply``) in each instance's workdir, then
    submits; and, per instance, the ``sampling_params`` that point its jobs at their script and size their
    token budgets to it (a long patch is one long turn: it must not end the rollout before it is applied).
    An instance without a patch submits without an edit (graded ``empty_patch``)."""
    book = ScriptBook(tok)
    params: list[dict[str, Any]] = []
    for i, inst in enumerate(instances):
        patch = patches.get(str(inst.get("instance_id")), "")
        workdir = str(inst.get("workdir") or "/testbed")
        key = f"i{i}"
        job: dict[str, Any] = book.add(key, gold_by_bash(patch, workdir) if patch.strip() else [])
        lengths = [len(tok.encode(turn)) + 1 for turn in book.scripts[key]]
        job.update(max_tokens_per_turn=max(1024, max(lengths)), context_budget=REPLAY_CONTEXT + sum(lengths))
        params.append(job)
    return book, params


def replay_context(params: Sequence[dict[str, Any]]) -> int:
    """The context length a replay server must accept for these jobs."""
    return max([REPLAY_CONTEXT, *(int(p.get("context_budget", 0)) for p in params)])
