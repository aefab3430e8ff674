"""A scripted inference server process for restart tests: ``python -m tests.doubles.turn_llm --port P
--script FILE [--start N] [--hold-at K] [--log FILE]``.

It answers its i-th request with completion ``start + i`` of the script (a JSON list of ``{"token_ids",
"logprobs"}``), so a server started after a restart can go on where the first one stopped. At completion
``hold-at`` it blocks until it is killed (the test kills the service while a job waits there, after the
turns before it were committed). ``--log`` appends one JSON line per request: the completion it answered
with and the prompt's token IDs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
from pathlib import Path

from raas.llm.scripted import Completion, CompletionRequest, ScriptedLLM


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m tests.doubles.turn_llm")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--script", type=Path, required=True)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--hold-at", type=int)
    p.add_argument("--log", type=Path)
    args = p.parse_args()
    script = [
        Completion(token_ids=c["token_ids"], logprobs=c["logprobs"])
        for c in json.loads(args.script.read_text())
    ]

    def respond(req: CompletionRequest) -> Completion:
        n = args.start + req.index
        if args.log is not None:
            with args.log.open("a") as f:
                f.write(json.dumps({"completion": n, "prompt_ids": req.prompt_ids}) + "\n")
        if n == args.hold_at:
            time.sleep(3600)  # the service is killed while it waits here
        return script[n]

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with ScriptedLLM(respond, port=args.port) as llm:
            print(f"SCRIPTED_LLM_READY {llm.url}", flush=True)
            await stop.wait()

    asyncio.run(run())


if __name__ == "__main__":
    main()
