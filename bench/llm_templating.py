"""Templating CPU time per agent turn at history lengths 1..N: append-only vs a full re-render.

A turn is what the agent loop does after each generate call: ``add_assistant(sampled IDs)`` plus
``add_messages([tool result])`` with the generation prompt. The goal is a flat curve: the cost of a turn
depends on the new tokens only. For comparison the cost of re-rendering and re-tokenizing the whole
conversation (what a text-based loop does every turn) is measured at the same history length.

Writes ``bench/results/templating.json`` (rows ``turn``, ``us_per_turn``, ``us_full_render``) and prints
the same JSON. Usage: ``python bench/llm_templating.py [--turns 50] [--reps 20] [--tokenizer DIR]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from raas.llm.models import default_tokenizer_dir
from raas.llm.template_check import SAMPLE_TOOLS
from raas.llm.tokenizer import ChatTokenizer

OUT = Path(__file__).parent / "results" / "templating.json"


def run(tok: ChatTokenizer, turns: int, reps: int) -> list[dict[str, float]]:
    first = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix the failing test in /workspace."},
    ]
    assistant = (
        tok.encode(
            'I will look.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
        )
        + tok.stop_token_ids()[:1]
    )
    observation = "README.md\nsetup.py\nsrc/\ntests/\n" * 4
    incremental: list[list[float]] = [[] for _ in range(turns)]
    full: list[list[float]] = [[] for _ in range(turns)]
    for _ in range(reps):
        # the two are timed in separate passes so one's garbage does not land on the other's clock
        conv = tok.conversation(first, tools=SAMPLE_TOOLS)
        snapshots: list[int] = []
        for t in range(turns):
            start = time.perf_counter()
            conv.add_assistant(assistant)
            conv.add_messages([{"role": "tool", "content": observation}])
            incremental[t].append(time.perf_counter() - start)
            snapshots.append(len(conv.messages))
        for t, n in enumerate(snapshots):
            start = time.perf_counter()
            tok.apply_chat_template(conv.messages[:n], tools=SAMPLE_TOOLS, add_generation_prompt=True)
            full[t].append(time.perf_counter() - start)
    return [
        {
            "turn": t + 1,
            "us_per_turn": round(statistics.median(incremental[t]) * 1e6, 1),
            "us_full_render": round(statistics.median(full[t]) * 1e6, 1),
        }
        for t in range(turns)
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--tokenizer", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    tok = ChatTokenizer.from_pretrained(args.tokenizer or default_tokenizer_dir())
    rows = run(tok, args.turns, args.reps)
    first, last = rows[0]["us_per_turn"], rows[-1]["us_per_turn"]
    result = {
        "benchmark": "llm_templating",
        "tokenizer": tok.name,
        "reps": args.reps,
        "rows": rows,
        "summary": {
            "us_per_turn_first": first,
            "us_per_turn_last": last,
            "growth_last_over_first": round(last / first, 2) if first else None,
            "us_full_render_last": rows[-1]["us_full_render"],
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
