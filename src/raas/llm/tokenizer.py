"""Token-exact chat templating.

RL trains on the exact IDs the policy sampled, so a trajectory's token IDs are built append-only:

    prompt(t+1) = prompt(t) + sampled_output_ids(t) + template_closing(t) + ids(new messages + gen prompt)

The closing and the new-message IDs are derived from the model's own chat template: the template is
rendered for a short fixed dummy conversation that ends with a message of the same role as the real
last message, with and without the new messages, and the difference is tokenized. That keeps the cost
of a turn proportional to the new tokens (never a re-render of the history) and needs no per-model
hard-coding. :func:`raas.llm.template_check.check_template` compares the result with a full re-render.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from raas.errors import RaasError

Message = dict[str, Any]

# A marker that no template rewrites (no whitespace to trim, no tags) and that tokenizers leave alone.
_MARK = "RAASMARK7f3a9c"
_DUMMY_PREFIX: tuple[Message, ...] = (
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
)

# Injected into the system message when the template itself cannot render tools (e.g. SmolLM2's
# ChatML): the Hermes format that :mod:`raas.agent.toolcalls` parses.
_HERMES_TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_HERMES_TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n</tool_call>'
)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` (training templates mark assistant spans with it):
    rendered as its body; raas derives its loss mask from what was sampled, not from the template."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    """Compile a chat template in the same sandboxed environment transformers uses."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationBlock]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateError as exc:
        raise RaasError(f"chat template does not compile: {exc}", kind="bad_request") from exc


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


@dataclass
class Segment:
    """A run of IDs in a conversation and where it came from.

    ``source`` is ``prompt`` (first render), ``sampled`` (policy output, loss mask 1), ``closing``
    (template tokens appended after the sampled output, mask 0) or ``messages`` (new messages and the
    generation prompt, mask 0).
    """

    source: str
    start: int
    end: int
    message_index: int | None = None


class ChatTokenizer:
    """A tokenizer plus its chat template, loaded from a local dir without torch or transformers."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str,
        *,
        special_tokens: dict[str, str] | None = None,
        eos_token_ids: Sequence[int] = (),
        name: str = "",
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens or {})
        self.name = name
        self._template = _compile(chat_template)
        self.supports_tools = "tools" in chat_template
        self.eos_token_ids = list(eos_token_ids)
        self._closing_cache: dict[str, str] = {}
        self._closing_ids: dict[str, list[int]] = {}

    # -- loading -----------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | Path, *, chat_template: str | None = None) -> ChatTokenizer:
        """Load ``tokenizer.json`` and the chat template (``tokenizer_config.json`` or
        ``chat_template.jinja``) from a local dir; hub names are not fetched."""
        root = Path(path)
        if not (root / "tokenizer.json").is_file():
            raise RaasError(f"{root} is not a tokenizer dir (no tokenizer.json)", kind="bad_request")
        try:
            tok = Tokenizer.from_file(str(root / "tokenizer.json"))
        except Exception as exc:
            raise RaasError(f"cannot read {root / 'tokenizer.json'}: {exc}", kind="bad_request") from exc
        config: dict[str, Any] = {}
        if (root / "tokenizer_config.json").is_file():
            try:
                config = json.loads((root / "tokenizer_config.json").read_text())
            except json.JSONDecodeError as exc:
                raise RaasError(f"bad tokenizer_config.json in {root}: {exc}", kind="bad_request") from exc
        template = chat_template or config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if not template and (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text()
        if not template:
            raise RaasError(f"{root} has no chat template", kind="bad_request")
        special = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            content = _token_content(config.get(key))
            if content is not None:
                special[key] = content
        eos_ids: list[int] = []
        eos = special.get("eos_token")
        if eos is not None:
            eos_id = tok.token_to_id(eos)
            if eos_id is not None:
                eos_ids.append(eos_id)
        gen_cfg = root / "generation_config.json"
        if gen_cfg.is_file():
            extra = json.loads(gen_cfg.read_text()).get("eos_token_id")
            for value in extra if isinstance(extra, list) else [extra]:
                if isinstance(value, int) and value not in eos_ids:
                    eos_ids.append(value)
        name = root.parent.name if root.name == "tokenizer" else root.name
        return cls(tok, str(template), special_tokens=special, eos_token_ids=eos_ids, name=name)

    # -- text <-> ids ------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Tokenize rendered template text; special tokens in the text map to their IDs."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    # -- rendering ---------------------------------------------------------------------------------
    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """Render messages with the chat template (what ``apply_chat_template(tokenize=False)`` does)."""
        msgs = list(messages)
        if tools and not self.supports_tools:
            msgs = _inject_tools(msgs, tools)
            tools = None
        try:
            return self._template.render(
                messages=msgs,
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
                **template_kwargs,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise RaasError(f"chat template failed: {exc}", kind="bad_request") from exc
        except (TypeError, KeyError, AttributeError, IndexError) as exc:
            raise RaasError(f"chat template failed on these messages: {exc!r}", kind="bad_request") from exc

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        **template_kwargs: Any,
    ) -> list[int]:
        """Full render + tokenize: the reference an append-only conversation is checked against."""
        return self.encode(
            self.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **template_kwargs)
        )

    def conversation(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> Conversation:
        """Start an append-only conversation from its first messages (system, user, ...)."""
        _validate_messages(messages)
        return Conversation(
            self,
            list(messages),
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            template_kwargs=template_kwargs,
        )

    # -- template-derived boundaries ---------------------------------------------------------------
    def closing_text(
        self, role: str, tools: Sequence[dict[str, Any]] | None = None, **template_kwargs: Any
    ) -> str:
        """Text the template emits after a message's content, e.g. ``<|im_end|>\\n`` for ChatML."""
        key = role if not template_kwargs and not tools else ""
        if key and key in self._closing_cache:
            return self._closing_cache[key]
        text = self.render([*_DUMMY_PREFIX, _dummy_of({"role": role})], tools=tools, **template_kwargs)
        at = text.find(_MARK)
        if at < 0:
            raise RaasError(f"chat template drops the content of {role!r} messages", kind="bad_request")
        closing = text[at + len(_MARK) :]
        if key:
            self._closing_cache[key] = closing
        return closing

    def closing_ids(self, role: str, **template_kwargs: Any) -> list[int]:
        """Token IDs of :meth:`closing_text` (cached when no template arguments are given)."""
        if template_kwargs:
            return self.encode(self.closing_text(role, **template_kwargs))
        cached = self._closing_ids.get(role)
        if cached is None:
            cached = self._closing_ids[role] = self.encode(self.closing_text(role))
        return list(cached)

    def stop_token_ids(self) -> list[int]:
        """IDs a server should stop on: the EOS tokens and the first token of the assistant closing."""
        ids = list(self.eos_token_ids)
        closing = self.encode(self.closing_text("assistant"))
        if closing and closing[0] not in ids:
            ids.append(closing[0])
        return ids


def _dummy_of(message: Message) -> Message:
    """A message of the same role and shape whose content is the marker."""
    dummy: Message = {"role": message.get("role", "user"), "content": _MARK}
    for key in ("name", "tool_call_id"):
        if key in message:
            dummy[key] = message[key]
    return dummy


def _inject_tools(messages: list[Message], tools: Sequence[dict[str, Any]]) -> list[Message]:
    block = _HERMES_TOOLS_HEADER + "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    block += _HERMES_TOOLS_FOOTER
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = f"{first.get('content') or ''}\n\n{block}"
        return [first, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


def _validate_messages(messages: Iterable[Any]) -> None:
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise RaasError(f"message {i} is not a {{'role': ..., 'content': ...}} dict", kind="bad_request")
        content = msg.get("content")
        if content is not None and not isinstance(content, str | list):
            raise RaasError(f"message {i} has content of type {type(content).__name__}", kind="bad_request")


@dataclass
class TurnRecord:
    """One assistant turn: where its sampled IDs sit and what the template appended."""

    sampled: tuple[int, int]
    closing_ids: list[int]
    message: Message


@dataclass
class Conversation:
    """An append-only token trajectory. ``ids`` never changes except at its end.

    ``mask`` is 1 for IDs the policy sampled and 0 for IDs the template or the environment supplied;
    ``logprobs`` carries the sampler's logprob for sampled IDs and ``None`` elsewhere.
    """

    tokenizer: ChatTokenizer
    messages: list[Message]
    tools: Sequence[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    _without: dict[str, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        first = self.tokenizer.apply_chat_template(
            self.messages,
            tools=self.tools,
            add_generation_prompt=self.add_generation_prompt,
            **self.template_kwargs,
        )
        self._append(first, "prompt", 0, None)
        self._open = self.add_generation_prompt

    @property
    def prompt_ids(self) -> list[int]:
        """The full prompt so far (the live list: do not mutate it)."""
        return self.ids

    def __len__(self) -> int:
        return len(self.ids)

    def _append(
        self,
        ids: Sequence[int],
        source: str,
        mask: int,
        logprobs: Sequence[float | None] | None,
        message_index: int | None = None,
    ) -> None:
        if not ids:
            return
        start = len(self.ids)
        self.ids.extend(ids)
        self.mask.extend([mask] * len(ids))
        if logprobs is not None:
            self.logprobs.extend(logprobs)
        else:
            self.logprobs.extend([None] * len(ids))
        self.segments.append(Segment(source, start, len(self.ids), message_index))

    def add_assistant(
        self, output_ids: Sequence[int], logprobs: Sequence[float | None] | None = None
    ) -> Message:
        """Append the IDs the policy sampled, then whatever the template's assistant closing still
        needs (e.g. ``\\n`` after a server-returned ``<|im_end|>``, or all of it when the server
        stripped the stop token or the output hit ``max_tokens``). Returns the decoded message."""
        output = list(output_ids)
        if logprobs is not None and len(logprobs) != len(output):
            raise RaasError(f"{len(logprobs)} logprobs for {len(output)} sampled IDs", kind="llm_error")
        tok = self.tokenizer
        closing_ids = tok.closing_ids("assistant", **self.template_kwargs)
        overlap = 0
        for k in range(min(len(closing_ids), len(output)), 0, -1):
            if output[-k:] == closing_ids[:k]:
                overlap = k
                break
        start = len(self.ids)
        self._append(
            output, "sampled", 1, list(logprobs) if logprobs is not None else None, len(self.messages)
        )
        appended = closing_ids[overlap:]
        self._append(appended, "closing", 0, None, len(self.messages))
        content = tok.decode(output[: len(output) - overlap])
        message: Message = {"role": "assistant", "content": content}
        self.messages.append(message)
        self.turns.append(TurnRecord((start, start + len(output)), appended, message))
        self._open = False
        return message

    def add_messages(self, messages: Sequence[Message], *, add_generation_prompt: bool = True) -> list[int]:
        """Append new messages (tool results, user turns) and the generation prompt; returns their IDs.

        The IDs come from the template: it is rendered for a dummy conversation ending with a message
        of the real last message's role, with and without the new messages; the difference is
        tokenized. Pass all tool results of one turn in one call (templates group them)."""
        _validate_messages(messages)
        new = list(messages)
        if not new:
            return []
        text = self._delta_text(new, add_generation_prompt)
        ids = self.tokenizer.encode(text)
        first_index = len(self.messages)
        self.messages.extend(new)
        self._append(ids, "messages", 0, None, first_index)
        self._open = add_generation_prompt
        return ids

    def _delta_text(self, new: list[Message], add_generation_prompt: bool) -> str:
        tok = self.tokenizer
        last = self.messages[-1] if self.messages else {"role": "user"}
        dummy = _dummy_of(last)
        base = [*_DUMMY_PREFIX, dummy]
        kwargs = self.template_kwargs
        key = json.dumps(dummy, sort_keys=True)
        without = self._without.get(key)
        if without is None:
            without = self._without[key] = tok.render(
                base, tools=self.tools, add_generation_prompt=False, **kwargs
            )
        with_new = tok.render(
            [*base, *new], tools=self.tools, add_generation_prompt=add_generation_prompt, **kwargs
        )
        a, b = without.find(_MARK), with_new.find(_MARK)
        if a >= 0 and b >= 0:
            closing = without[a + len(_MARK) :]
            tail = with_new[b + len(_MARK) :]
            if tail.startswith(closing):
                return tail[len(closing) :]
        # The template renders the previous message differently once something follows it (e.g.
        # consecutive tool results grouped into one block). Append-only is still required, so render
        # the new messages as if they followed an assistant turn and say so.
        self.notes.append(
            f"message {len(self.messages)}: the template re-renders the previous {last.get('role')!r} "
            "message when new messages follow it; new messages were rendered after a closed turn"
        )
        base = [*_DUMMY_PREFIX, _dummy_of({"role": "assistant"})]
        without = tok.render(base, tools=self.tools, add_generation_prompt=False, **kwargs)
        with_new = tok.render(
            [*base, *new], tools=self.tools, add_generation_prompt=add_generation_prompt, **kwargs
        )
        if with_new.startswith(without):
            return with_new[len(without) :]
        raise RaasError(
            "cannot derive an append-only rendering of the new messages from the chat template",
            kind="bad_request",
        )

    def loss_mask(self) -> list[int]:
        return list(self.mask)
