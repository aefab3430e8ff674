"""How often a real rollout replays exactly: the embedded model (``raas llm serve``, as ``python -m raas.cli``) driving a built-in task's
tools in real sandboxes, the service (``python -m raas.api``) SIGKILLed while jobs are inside RUN with
committed turns, then started again.

Every job that was inside RUN at a kill comes back with ``timing.resumed_at: "run"``: it either replayed
its committed turns (the tools answered as before) and went on, or ended ``replay_diverged``. The report
counts both, with the diverging messages, so the ``resume`` default can be judged on tools that really ran
(``bench/restart_soak.py`` measures the same machinery on scripted turns). Writes
``bench/results/replay_real_<task>.json``. Usage:
``python bench/replay_real.py [--task lookup] [--jobs 24] [--kills 3] [--sandbox local]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from restart_soak import REPO, TERMINAL, Ledger, free_port  # bench/ is this script's directory

OUT_DIR = Path(__file__).parent / "results"


def start_service(work: Path, port: int, llm: str, tokenizer: Path, sandbox: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("RAAS_API_TOKEN", None)
    config = work / "service.json"
    config.write_text(json.dumps({"sandbox": {"backend": sandbox}, "shutdown_grace_s": 0}))
    cmd = [
        sys.executable,
        "-m",
        "raas.api",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--config",
        str(config),
    ]
    cmd += ["--state-dir", str(work / "state"), "--llm", llm, "--tokenizer-dir", str(tokenizer)]
    cmd += ["--init-workers", "2", "--run-workers", "4", "--eval-workers", "2", "--log-level", "warning"]
    with open(work / "service.log", "ab") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    while True:
        if proc.poll() is not None:
            raise SystemExit("the service exited: " + (work / "service.log").read_text()[-3000:])
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.1)


def in_run_with_turns(ledger: Ledger) -> int:
    return int(
        ledger.query(
            "SELECT COUNT(DISTINCT c.job_id) FROM checkpoints c JOIN jobs j ON j.job_id = c.job_id "
            "WHERE c.stage LIKE 'turn:%' AND j.status = 'run'"
        )[0][0]
    )


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from raas.llm.models import prepare_tokenizer
    from raas.tasks.datasets import load_dataset

    tokenizer = prepare_tokenizer()
    llm_port, port = free_port(), free_port()
    llm = subprocess.Popen(
        [sys.executable, "-m", "raas.cli", "llm", "serve", "--port", str(llm_port), "--parallel", "4"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert llm.stdout is not None
    llm_url = llm.stdout.readline().strip()
    svc = start_service(work, port, llm_url, tokenizer, args.sandbox)
    ledger = Ledger(work / "state" / "ledger.sqlite3")
    instances = load_dataset(f"builtin:{args.task}")[: args.jobs]
    sampling = {"temperature": 1.0, "max_turns": args.max_turns}
    jobs = [
        {"job_id": f"{args.task}-{i}", "instance": inst, "sampling_params": sampling}
        for i, inst in enumerate(instances)
    ]
    started = time.monotonic()
    try:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/jobs:batch", json={"jobs": jobs}, timeout=60)
        assert r.status_code == 202, r.text
        kills: list[dict[str, Any]] = []
        while True:
            marks = ",".join(f"'{s}'" for s in TERMINAL)
            left = ledger.query(f"SELECT COUNT(*) FROM jobs WHERE status NOT IN ({marks})")[0][0]
            if not left:
                break
            caught = in_run_with_turns(ledger)
            if len(kills) < args.kills and caught >= args.min_caught:
                svc.send_signal(signal.SIGKILL)
                svc.wait(60)
                kills.append({"at_s": round(time.monotonic() - started, 1), "in_run_with_turns": caught})
                print(json.dumps({"kill": len(kills), **kills[-1]}), flush=True)
                svc = start_service(work, port, llm_url, tokenizer, args.sandbox)
                time.sleep(args.gap_s)
            time.sleep(0.2)
    finally:
        svc.send_signal(signal.SIGTERM)
        svc.wait(60)
        llm.terminate()
        llm.wait(60)
    results = [json.loads(r) for (r,) in ledger.query("SELECT result FROM jobs")]
    resumed = [r for r in results if r["timing"].get("resumed_at") == "run"]
    outcomes: Counter[str] = Counter()
    diverged = []
    for r in resumed:
        kind = r["error"]["kind"] if r.get("error") else r["status"]
        outcomes[kind] += 1
        if kind == "replay_diverged":
            diverged.append({"job_id": r["job_id"], "message": r["error"]["message"]})
    replayed = [(r["artifacts"].get("resumed") or {}) for r in resumed if r["status"] == "completed"]
    return {
        "task": args.task,
        "jobs": len(jobs),
        "kills": kills,
        "resumed_in_run": len(resumed),
        "outcomes": dict(outcomes),
        "replayed_turns": sum(int(x.get("replayed_turns", 0)) for x in replayed),
        "committed_turns": sum(
            int((r["artifacts"].get("resumed") or {}).get("committed_turns", 0)) for r in resumed
        ),
        "all_statuses": dict(Counter(r["status"] for r in results)),
        "diverged": diverged[:20],
        "wall_s": round(time.monotonic() - started, 1),
        "sandbox": args.sandbox,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="lookup", help="a built-in task: lookup, math, stem, code")
    p.add_argument("--jobs", type=int, default=24)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--min-caught", type=int, default=2, help="kill once this many jobs are in RUN with turns")
    p.add_argument("--gap-s", type=float, default=10.0, help="seconds between a restart and the next kill")
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--sandbox", default="local")
    p.add_argument("--output", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="raas-replay-") as work:
        result = run(args, Path(work))
    result["command"] = "python bench/replay_real.py " + " ".join(sys.argv[1:])
    out = args.output or OUT_DIR / f"replay_real_{args.task}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
