"""A minimal tool-calling agent on the OpenAI SDK: the contract an agent behind the raas gateway meets.

It knows nothing about raas beyond the environment: the task instance arrives as JSON on stdin (also at
``$RAAS_INSTANCE``); the policy answers at ``$OPENAI_BASE_URL`` with key ``$OPENAI_API_KEY`` and model
``$RAAS_MODEL``; the agent works in its current directory (the repository) and exits when it is done.
``$RAAS_MAX_STEPS`` bounds its model calls; ``RAAS_AGENT_STREAM=1`` makes it stream its replies.

raas copies this file into the sandbox and runs it with the harness image's Python (``openai`` installed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from openai import OpenAI

SYSTEM = (
    "You are a software engineer working in a git repository (your current directory). Use the bash tool "
    "to inspect and change files and to run tests. When the task is solved, call the submit tool."
)
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a bash command in the repository and return its output and exit code.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string", "description": "the command"}},
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "submit",
            "description": "Finish: the task is solved.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]
OUTPUT_CAP = 8000


def run_bash(command: str, timeout_s: float = 120.0) -> str:
    try:
        done = subprocess.run(
            ["bash", "-c", command], capture_output=True, text=True, timeout=timeout_s, errors="replace"
        )
    except subprocess.TimeoutExpired:
        return f"(timed out after {timeout_s:g} s)"
    output = (done.stdout + done.stderr)[-OUTPUT_CAP:]
    return f"{output}\n(exit code {done.returncode})"


def ask(client: OpenAI, model: str, messages: list[Any], stream: bool) -> dict[str, Any]:
    """One model call; returns the assistant message as a dict (streamed replies are reassembled)."""
    if not stream:
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
        message: dict[str, Any] = reply.choices[0].message.model_dump(exclude_none=True)
        return {k: v for k, v in message.items() if k in ("role", "content", "tool_calls")}
    content = ""
    calls: dict[int, dict[str, Any]] = {}
    for chunk in client.chat.completions.create(model=model, messages=messages, tools=TOOLS, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            call = calls.setdefault(
                tc.index, {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
            )
            call["id"] = tc.id or call["id"]
            if tc.function is not None:
                call["function"]["name"] += tc.function.name or ""
                call["function"]["arguments"] += tc.function.arguments or ""
    out: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        out["tool_calls"] = [calls[i] for i in sorted(calls)]
    return out


def main() -> int:
    instance = json.load(sys.stdin)
    client = OpenAI()  # OPENAI_BASE_URL, OPENAI_API_KEY
    model = os.environ.get("RAAS_MODEL", "raas-policy")
    stream = os.environ.get("RAAS_AGENT_STREAM") == "1"
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": instance["task"]},
    ]
    for step in range(int(os.environ.get("RAAS_MAX_STEPS", "30"))):
        message = ask(client, model, messages, stream)
        messages.append(message)
        calls = message.get("tool_calls") or []
        if not calls:
            messages.append(
                {"role": "user", "content": "Use the bash tool, or call submit when the task is solved."}
            )
            continue
        for call in calls:
            name = call["function"]["name"]
            try:
                args = json.loads(call["function"]["arguments"] or "{}")
            except json.JSONDecodeError as exc:
                messages.append(
                    {"role": "tool", "tool_call_id": call["id"], "content": f"bad arguments: {exc}"}
                )
                continue
            if name == "submit":
                print(json.dumps({"submitted": True, "steps": step + 1}))
                return 0
            result = run_bash(str(args.get("command", ""))) if name == "bash" else f"unknown tool {name!r}"
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": result})
    print(json.dumps({"submitted": False, "steps": int(os.environ.get("RAAS_MAX_STEPS", "30"))}))
    return 1


if __name__ == "__main__":
    sys.exit(main())
