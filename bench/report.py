"""Print the benchmark tables of docs/benchmarks.md (Markdown) from the JSON files under ``bench/results/``.

Usage: ``python bench/report.py`` — docs/benchmarks.md's tables are this script's output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def _load(name: str) -> Any | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def _table(header: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def tools_latency() -> str:
    rows = _load("tools_latency.json")
    if not rows:
        return ""
    rows = rows if isinstance(rows, list) else rows.get("rows", [])
    body = []
    for r in rows:
        extras = []
        if r["kind"].startswith("start_"):
            extras.append(f"all ready {r.get('all_ready_ms', '?')} ms")
        if "idle_rss_kb" in r:
            extras.append(
                f"idle RSS {r['idle_rss_kb'] / 1024:.1f} MB (PSS {r.get('idle_pss_kb', 0) / 1024:.1f} MB)"
            )
        if "cpu_ms_per_start" in r:
            extras.append(f"CPU {r['cpu_ms_per_start']} ms per start")
        if r["kind"].startswith("live_"):
            extras.append(
                f"PSS {r['pss_kb_per_sandbox_p50'] / 1024:.1f} MB per idle sandbox (RSS "
                f"{r['rss_kb_per_sandbox_p50'] / 1024:.1f} MB), {r['processes_per_sandbox']} processes each"
            )
        if "calls_per_s" in r:
            extras.append(f"{r['calls_per_s']} calls/s in all")
        if "load_avg_1m" in r:
            extras.append(f"load {r['load_avg_1m']}")
        cells = [r.get(k, "") for k in ("p50_ms", "p90_ms", "p99_ms")]
        body.append([r["backend"], r["kind"], *cells, r["n"], "; ".join(extras)])
    machine = rows[0].get("machine", {}) if rows else {}
    before = machine.get("load_avg_1m_before", machine.get("load_avg_1m", "?"))
    return (
        "### Tool latency (`python bench/tools_latency.py`)\n\n"
        "Host API call → Unix socket → tool server in the sandbox → pty bash → back. `start` is sandbox\n"
        "start-to-ready, cold; `claim` is the same from a warm pool; `start_K` is K sandboxes started at once\n"
        "(per-sandbox latencies; 'all ready' when the last one was); `live_N` is the memory of N idle\n"
        "sandboxes; `busy_N` is `echo` while N sandboxes run echo calls back to back. Load average (1 min,\n"
        f"2 cores) at the start of the run: {before}, and per row.\n\n"
        + _table(["backend", "kind", "p50 ms", "p90 ms", "p99 ms", "n", ""], body)
    )


def transfer() -> str:
    data = _load("transfer.json")
    if not data:
        return ""
    rows = []
    for name, label in (("alone", "A alone"), ("during_transfer", "A while B transfers")):
        r = data[name]
        rows.append(
            [
                label,
                r["n"],
                r["p50_ms"],
                r["p90_ms"],
                r["p99_ms"],
                r["max_ms"],
                r["loop_worst_stall_ms"],
                "-".join(str(x) for x in r["load_avg_1m"]),
            ]
        )
    during = data["during_transfer"]
    return (
        "### One sandbox's transfers vs another's tool calls (`python bench/transfer.py`)\n\n"
        f"Two {data['backend']} sandboxes on one event loop: A runs `echo hello` through the bash tool, alone, "
        f"then while B writes and reads back {data['payload_mb']} MB {during.get('transfer_rounds', '?')} "
        f"times ({during.get('transfer_mb_per_s', '?')} MB/s both ways together). 'Loop stall' is the longest "
        "a 1 ms timer fired late. Load average (1 min) before-after each phase is in the last column.\n\n"
        + _table(["phase", "n", "p50 ms", "p90 ms", "p99 ms", "max ms", "loop stall ms", "load avg"], rows)
    )


def templating() -> str:
    data = _load("templating.json")
    if not data:
        return ""
    picks = {1, 2, 5, 10, 20, 30, 40, 50}
    body = [
        [r["turn"], r["us_per_turn"], r.get("us_full_render", "")] for r in data["rows"] if r["turn"] in picks
    ]
    return (
        "### Templating cost per turn (`python bench/llm_templating.py`)\n\n"
        "CPU time to append one turn (tool result + generation prompt) at a given history length, vs a full\n"
        "re-render of the whole conversation (what append-only templating avoids).\n\n"
        + _table(["turn", "µs per turn (append-only)", "µs full re-render"], body)
    )


def prefix_cache() -> str:
    data = _load("prefix_cache.json")
    if not data:
        return ""
    body = [
        [name, data[name]["hit_rate"], data[name]["best_possible_hit_rate"], data[name]["wall_s"]]
        for name in ("sticky", "round_robin")
        if name in data
    ]
    return (
        "### Prefix-cache hits, sticky vs round robin (`python bench/llm_prefix_cache.py`)\n\n"
        f"Two real llama-server instances, {data.get('trajectories')} trajectories x {data.get('turns')} "
        "turns; hit rate = cached prompt tokens / prompt tokens after each trajectory's first turn "
        "(llama.cpp's `cache_n`).\n\n" + _table(["routing", "hit rate", "best possible", "wall s"], body)
    )


def llm_routing() -> str:
    data = _load("llm_routing.json")
    if not data:
        return ""
    header = ["routing", "hit rate", "prefill tokens", "cached (saved)", "saved vs round robin"]
    header += ["servers per group", "wall s"]
    body = [
        [
            name,
            p["hit_rate"],
            p["prefill_tokens"],
            p["cached_tokens"],
            p.get("prefill_saved_vs_round_robin", ""),
            p["servers_per_group_mean"],
            p["wall_s"],
        ]
        for name, p in data["policies"].items()
    ]
    load = f"load average {data['loadavg_before']} before, {data['loadavg_after']} after"
    return (
        "### Prefix-cache hits per routing policy (`python bench/llm_routing.py`)\n\n"
        f"Two real llama-servers ({data['parallel_per_server']} slots, {data['threads_per_server']} thread "
        f"each), {data['groups']} GRPO groups x {data['samples']} samples, a {data['prompt_tokens_first_turn']}-"
        f"token prompt per group, {data['turns']} turn(s) of {data['max_tokens']} tokens, {data['concurrency']} "
        f"samples in flight, started in group order; prompt tokens {next(iter(data['policies'].values()))['prompt_tokens']}, "
        f"of which at least {next(iter(data['policies'].values()))['min_prefill_tokens']} must be prefilled; "
        f"llama.cpp's `timings.cache_n` / `prompt_n` per request; {load} ({data['cpus']} cores).\n\n"
        + _table(header, body)
        + "\n\nllama.cpp reuses a prompt only from an idle slot or its RAM prompt cache, never from a request "
        "still running (checked on this build), so the samples of a group that start together on one server "
        "each prefill; the savings come from the samples that start after a sibling there finished. Wall "
        "times are dominated by the shared machine's load."
    )


def client_overhead() -> str:
    data = _load("client_overhead.json")
    if not data:
        return ""
    body = [
        [name, data[name]["median_us"], data[name]["p90_us"]]
        for name in ("raw", "client", "balancer")
        if name in data
    ]
    return (
        "### Client overhead (`python bench/llm_client_overhead.py`)\n\n"
        f"{data.get('requests')} requests of {data.get('output_tokens')} tokens against a local server: a raw "
        "httpx call vs raas's server client vs the balancer.\n\n"
        + _table(["path", "median µs", "p90 µs"], body)
    )


def pipeline() -> str:
    data = _load("pipeline.json")
    if not data:
        return ""
    over = data.get("overhead", {})
    body = [
        [
            name + (" + warm pool" if o.get("warm_pool") else ""),
            o.get("rollouts"),
            o.get("rollouts_per_s"),
            o.get("service_cpu_ms_per_rollout", ""),
            o.get("tree_cpu_ms_per_rollout") or "",
            o.get("added_latency_ms_p50"),
            o.get("added_latency_ms_p99"),
            o.get("init_ms_p50"),
            (o.get("burst_32") or {}).get("all_done_s", ""),
            o.get("load_avg_1m", ""),
        ]
        for name, row in over.items()
        for o in ([row, row["pool"]] if "pool" in row else [row])
    ]
    dec = data.get("decoupling", {})
    params = dec.get("params", {})
    rss = data.get("rss", {})
    parts = [
        "### Pipeline (`python bench/pipeline.py`)\n",
        "Service overhead: a trivial task, an instant test-double LLM; `none` opens no sandbox; '+ warm pool': "
        "with `warm_pool` on (min 8, max 32); '32 after a pause': a batch of 32 submitted at once after the run "
        "(with pools: once the pool refilled), until all are done. 'All processes': the service, its "
        "sandboxes and the test-double LLM together (the benchmark's own cgroup; other work on the machine "
        "not included), the load-independent cost of a rollout.\n",
        _table(
            [
                "sandbox",
                "rollouts",
                "rollouts/s",
                "service CPU ms per rollout",
                "all processes' CPU ms per rollout",
                "added latency p50 ms",
                "p99 ms",
                "INIT (sandbox start) p50 ms",
                "32 after a pause, s",
                "load avg",
            ],
            body,
        ),
        "",
        "Decoupling: a vLLM-protocol test double with a fixed capacity "
        f"({params.get('capacity')} sequences, {params.get('tokens_per_s')} tok/s each), log-normal INIT/EVAL "
        f"(medians {params.get('init_median_s')} s / {params.get('eval_median_s')} s, sigma {params.get('sigma')}), "
        f"{params.get('jobs')} jobs, {params.get('total_workers')} workers in total for both designs.\n",
        _table(
            ["design", "LLM utilization", "rollouts/s"],
            [
                ["raas (three pools)", data.get("llm_utilization"), data.get("rollouts_per_s")],
                [
                    "coupled (one pool)",
                    data.get("coupled_llm_utilization"),
                    data.get("coupled_rollouts_per_s"),
                ],
            ],
        ),
        "",
        f"Memory: RSS over {rss.get('rollouts')} trivial rollouts: {rss.get('rss_mb_after_warmup')} MB after "
        f"warm-up, {rss.get('rss_mb_end')} MB at the end (growth {rss.get('growth_after_warmup_mb')} MB).",
    ]
    return "\n".join(parts)


def verify_overhead() -> str:
    data = _load("verify_overhead.json")
    if not data:
        return ""
    rows = [
        ["no-op", data["noop_thread"]["median_us"], data["noop_process"]["median_us"]],
        ["math-verify check", data["math_thread"]["median_us"], data["math_process"]["median_us"]],
    ]
    return (
        "### Verifier calls, thread vs killable worker (`python bench/verify_overhead.py`)\n\n"
        f"{data.get('calls')} calls each, interleaved; a new worker's first call (spawn + sympy import) took "
        f"{data.get('cold_start_s')} s. Load average: {data.get('machine', {}).get('load_avg_1m', '?')}.\n\n"
        + _table(["call", "thread median µs", "worker process median µs"], rows)
    )


def gateway() -> str:
    data = _load("gateway.json")
    if not data:
        return ""
    rows = []
    for key, label in (("rollouts_1", "1"), ("rollouts_64", "64")):
        r = data.get(key)
        if not r:
            continue
        cpu = r.get("service_cpu_ms_per_request", {})
        rows.append(
            [
                label,
                r["direct"]["p50_ms"],
                r["direct"]["p99_ms"],
                r["gateway"]["p50_ms"],
                r["gateway"]["p99_ms"],
                r["added_p50_ms"],
                r["added_p99_ms"],
                f"{cpu.get('direct', '?')} → {cpu.get('gateway', '?')}",
                r.get("client_cpu_ms_per_request", ""),
            ]
        )
    for key, r in data.items():
        if key.startswith("rollouts_1_in_"):
            sandbox = key.removeprefix("rollouts_1_in_").removesuffix("_sandbox")
            rows.append(
                [
                    f"1, agent in {sandbox}",
                    data["rollouts_1"]["direct"]["p50_ms"],
                    data["rollouts_1"]["direct"]["p99_ms"],
                    r["gateway"]["p50_ms"],
                    r["gateway"]["p99_ms"],
                    r["added_p50_ms"],
                    r["added_p99_ms"],
                    "",
                    "",
                ]
            )
    return (
        "### Agent gateway (`python bench/gateway.py --sandbox bwrap`)\n\n"
        "Per model call: an OpenAI Chat Completions request through the gateway (the agent re-sends its growing\n"
        "history each turn; every request after the first continues append-only) vs the direct token call\n"
        f"raas's own loop makes; scripted policy, {data.get('tokens_per_reply')} tokens per reply, three processes\n"
        f"on {data.get('cpus')} cores. Load average at the start: {data.get('load_before', '?')}. The last two\n"
        "columns: the service process's CPU per request (balancer alone → balancer + gateway), which contention\n"
        "does not change, and the agents' own CPU per request (httpx and JSON of the re-sent history: what any\n"
        "OpenAI-compatible server costs an agent). Wall-clock numbers include queueing for the 2 cores that the\n"
        "service, the agents' process and the policy process share (and whatever else ran on the machine).\n\n"
        + _table(
            [
                "rollouts at once",
                "direct p50 ms",
                "direct p99 ms",
                "gateway p50 ms",
                "gateway p99 ms",
                "added p50 ms",
                "added p99 ms",
                "service CPU ms/request",
                "agent CPU ms/request",
            ],
            rows,
        )
    )


def dapo() -> str:
    data = _load("dapo.json")
    if not data:
        return ""
    names = {
        "batch": "(a) generate a batch, filter, repeat",
        "async": "(b) asynchronous sampler",
        "carry": "(c) asynchronous sampler + carry-over",
    }
    rows = []
    for key, label in names.items():
        v = data["variants"][key]
        rows.append(
            [
                label,
                round(v["wait_s"], 1),
                round(data["variants"]["batch"]["wait_s"] / v["wait_s"], 2),
                round(v["wall_s"], 1),
                int(v["rollouts_finished"]),
                int(v["rollouts_used"]),
                int(v["rollouts_wasted"]),
                int(v["jobs_cancelled"]),
                f"{v['llm_idle_fraction']:.0%}",
            ]
        )
    header = [
        "variant",
        "trainer waited s",
        "speedup",
        "wall s",
        "rollouts finished",
        "used",
        "wasted",
        "jobs cancelled",
        "LLM idle",
    ]
    return _table(header, rows)


def swe() -> str:
    data = _load("swe.json")
    if not data:
        return ""
    rows = []
    for backend, b in data["backends"].items():
        p = b["p50"]
        rows.append(
            [
                backend,
                p["init_s"],
                p["run_s_gold"],
                p["prewarm_s"],
                p["eval_s_gold_prewarmed"],
                p["eval_s_gold_fresh"],
                p["test_run_s_gold"],
                p["eval_s_wrong"],
                p["eval_s_empty"],
                f"{b['resolved'].get('gold', 0)}/{data['instances']}",
                f"{b['resolved'].get('wrong', 0)}/{data['instances']}",
                f"{b['resolved'].get('empty', 0)}/{data['instances']}",
            ]
        )
    header = [
        "backend",
        "INIT",
        "RUN (gold)",
        "prewarm (overlaps RUN)",
        "EVAL prewarmed",
        "EVAL fresh",
        "of which tests",
        "EVAL wrong",
        "EVAL empty",
        "gold resolved",
        "wrong resolved",
        "empty resolved",
    ]
    sif = data["image"].get("sif") or {}
    note = (
        f"p50 seconds over {data['instances']} instances; load average {data.get('load_avg_start')} at the start. "
        f"Image: an instance rootfs packed as a {sif.get('sif_mb', '?')} MB SIF in {sif.get('pack_s', '?')} s, "
        f"converted once into the cache in {sif.get('convert_s', '?')} s (later look-ups "
        f"{sif.get('cached_lookup_ms', '?')} ms)."
    )
    return note + "\n\n" + _table(header, rows)


FLOOR_ROWS = {
    "python_bare_service": "`python -S -c pass`, the service's interpreter (what `local` runs)",
    "python_bare_distribution": "`python3 -S -c pass`, Debian's (an image's)",
    "bwrap_true": "`bwrap` (image read-only, every namespace unshared) running `/bin/true`",
    "apptainer_true": "`apptainer exec` with raas's flags running `/bin/true`",
    "bash_true": "`bash -c true`",
}


def floors() -> str:
    data = _load("floors.json")
    if not data:
        return ""
    got = data["floors"]

    def ms(v: float) -> str:
        return f"{v:.3g} ms" if v < 100 else f"{v:.0f} ms"

    rows = [
        [label, ms(got[k]["cpu_ms"]), ms(got[k]["wall_ms"])] for k, label in FLOOR_ROWS.items() if k in got
    ]
    return _table(["floor", "CPU", "wall"], rows)


def main() -> None:
    sections = [
        tools_latency(),
        transfer(),
        templating(),
        prefix_cache(),
        llm_routing(),
        client_overhead(),
        pipeline(),
        verify_overhead(),
        gateway(),
        dapo(),
        swe(),
        floors(),
    ]
    print("\n\n".join(s for s in sections if s))


if __name__ == "__main__":
    main()
