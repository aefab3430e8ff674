"""The reference trainer's resident memory: ``raas train`` for a few steps, its RSS sampled from outside.

Why: a 25-step run of ``raas train`` on ``builtin:addition`` (SmolLM2-135M) was seen at ~8 GB resident.
This runs ``raas train`` (the defaults on ``builtin:addition``, no evaluation) as a child process and
samples ``/proc/PID/status`` every 0.2 s: the trainer process's own ``VmRSS`` (its peak, and after each
step) and, apart, its children's (the policy's llama.cpp server). ``--src DIR`` runs another checkout's
code (``PYTHONPATH=DIR``) with this virtualenv, for a before/after on the same machine.

Usage: ``python bench/trainer_memory.py --steps 6 --label after``, and
``python bench/trainer_memory.py --steps 6 --label before --src /path/to/older/checkout/src``; each run is
merged into ``bench/results/trainer_memory.json`` under its label. Extra ``raas train`` options go after
``--``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


def rss_kb(pid: int) -> int:
    """``VmRSS`` of ``pid`` in kB (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux's ``/proc/PID/task/*/children``)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                kids = Path(f"/proc/{p}/task/{t}/children").read_text().split()
            except OSError:
                continue
            for k in map(int, kids):
                out.append(k)
                todo.append(k)
    return out


def measure(steps: int, src: str | None, extra: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="raas-bench-mem-") as tmp:
        env = dict(os.environ)
        if src:
            env["PYTHONPATH"] = src
        cmd = [sys.executable, "-m", "raas.cli", "train", "--steps", str(steps), "--eval-every", "0"]
        cmd += ["-o", tmp, "--no-progress", *extra]
        started = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        peak = peak_children = 0
        samples: list[tuple[float, int]] = []
        while proc.poll() is None:
            now = rss_kb(proc.pid)
            peak = max(peak, now)
            peak_children = max(peak_children, sum(rss_kb(k) for k in descendants(proc.pid)))
            samples.append((time.monotonic() - started, now))
            time.sleep(0.2)
        _, err = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"raas train failed ({proc.returncode}):\n{err[-3000:]}")
        log = Path(tmp) / "train.jsonl"
        records = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    step_rows = [r for r in records if r.get("kind") == "step"]
    return {
        "steps": len(step_rows),
        "wall_s": round(time.monotonic() - started, 1),
        "trainer_peak_rss_mb": round(peak / 1024),
        "trainer_final_rss_mb": round(next((kb for _, kb in reversed(samples) if kb), 0) / 1024),
        "children_peak_rss_mb": round(peak_children / 1024),
        "rss_mb_per_step_from_log": [r.get("rss_mb") and round(r["rss_mb"]) for r in step_rows],
        "train_s_per_step": [round(r["train_s"], 1) for r in step_rows],
        "rows_per_step": [r.get("rows") for r in step_rows],
        "command": " ".join(cmd[1:]),
        "src": src or str(REPO / "src"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--label", default="current")
    ap.add_argument("--src", help="run this checkout's src/ instead of this one's")
    ap.add_argument("--out", type=Path, default=RESULTS / "trainer_memory.json")
    ap.add_argument("extra", nargs="*", help="more raas train options (after --)")
    args = ap.parse_args()
    result = {"cpu_cores": os.cpu_count(), "load_average_at_start": round(os.getloadavg()[0], 2)}
    result.update(measure(args.steps, args.src, args.extra))
    print(json.dumps(result, indent=1))
    runs = json.loads(args.out.read_text()) if args.out.exists() else {}
    runs[args.label] = result
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps(runs, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
