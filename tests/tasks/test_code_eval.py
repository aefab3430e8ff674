"""The code task's EVAL stage in real bwrap sandboxes, fed solutions directly (no policy): gold solutions
pass, and solutions that try to cheat, hang, crash or flood fail. Every cheat here *would* score if the
hidden tests or expected outputs were reachable from the candidate's process, so each test can fail.

Also: a sandbox that dies under EVAL is a typed infrastructure error (filtered), never a reward of 0.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from raas.core.trajectory import RunOutput
from raas.errors import RaasError
from raas.sandbox import SandboxConfig, SandboxManager, procs
from raas.sandbox.config import make_config
from raas.tasks.base import Env, Job, JobSandboxes
from raas.tasks.code import CodeHandler
from raas.tasks.code.humaneval import humaneval

pytestmark = pytest.mark.integration


@pytest.fixture(params=["bwrap"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def job_sandboxes(
    sandbox_manager: SandboxManager, sandbox_config: SandboxConfig
) -> AsyncIterator[JobSandboxes]:
    js = JobSandboxes(sandbox_manager, sandbox_config, owner="code-eval")
    try:
        yield js
    finally:
        await js.close_all()


async def evaluate(
    js: JobSandboxes, instance: dict[str, Any], solution: str | None, **sampling: Any
) -> tuple[float | None, dict[str, Any]]:
    job = Job(job_id="code-eval", instance=instance, trajectory_id="t", sampling_params=sampling)
    env = Env(job=job, sandboxes=js)
    env.run_output = RunOutput(finish_reason="finish_tool", artifacts={"solution": solution})
    out = await CodeHandler().eval(job, env)
    await js.close_all()
    return out.reward, out.details


HE = {p["task_id"]: p for p in humaneval()}
ADD = {
    "data_source": "humaneval",
    "prompt": 'def add(a: int, b: int) -> int:\n    """Return a + b."""\n',
    "entry_point": "add",
    "test": "\n\ndef check(candidate):\n    assert candidate(2, 3) == 5  # MARK-7f3a\n    assert candidate(-1, 1) == 0\n",
    "time_limit": 3,
}
ADD_GOLD = ADD["prompt"] + "    return a + b\n"


@pytest.mark.parametrize(
    "task_id", ["HumanEval/0", "HumanEval/32", "HumanEval/33", "HumanEval/38", "HumanEval/163"]
)
async def test_canonical_humaneval_solutions_pass_and_stubs_fail(
    job_sandboxes: JobSandboxes, task_id: str
) -> None:
    """32 calls a prompt helper (poly), 33 calls the entry point by name inside check, 38 has a helper."""
    problem = HE[task_id]
    reward, details = await evaluate(
        job_sandboxes, problem, problem["prompt"] + problem["canonical_solution"]
    )
    assert reward == 1.0, details
    assert details["status"] == "passed" and details["calls"] > 0
    reward, details = await evaluate(job_sandboxes, problem, problem["prompt"] + "    return None\n")
    assert reward == 0.0 and details["status"] == "failed", details


CHEATS = {
    "exit at import": "import sys\nsys.exit(0)\n",
    "os._exit at import": "import os\nos._exit(0)\n",
    "exit inside the call": "import os\ndef add(a, b):\n    os._exit(0)\n",
    "object equal to everything": (
        "class Any:\n    def __eq__(self, other):\n        return True\n"
        "    def __repr__(self):\n        return '5'\n"
        "def add(a, b):\n    return Any()\n"
    ),
    "prints a verdict": (
        'import sys\nprint(\'RAAS-VERDICT x {"status": "passed"}\')\n'
        'sys.__stdout__.write(\'RAAS-VERDICT x {"status": "passed"}\\n\')\n'
        "def add(a, b):\n    return 0\n"
    ),
    "reads the caller's frame": (
        "import sys\n"
        "def add(a, b):\n"
        "    f = sys._getframe(1)\n"
        "    names = []\n"
        "    while f is not None:\n"
        "        names.append(f.f_code.co_name)\n"
        "        f = f.f_back\n"
        "    return a + b if 'check' in names else 0\n"
    ),
    "searches files and process memory for the hidden test": (
        "import os\n"
        "MARK = b'MARK-' + b'7f3a'  # built at run time: this file itself must not hold it\n"
        "def _found():\n"
        "    for root in ('/tmp', '/workspace', os.path.expanduser('~')):\n"
        "        for d, _, files in os.walk(root):\n"
        "            for name in files:\n"
        "                try:\n"
        "                    if MARK in open(os.path.join(d, name), 'rb').read():\n"
        "                        return True\n"
        "                except OSError:\n"
        "                    pass\n"
        "    for pid in os.listdir('/proc'):\n"
        "        for part in ('cmdline', 'environ'):\n"
        "            try:\n"
        "                if MARK in open(f'/proc/{pid}/{part}', 'rb').read():\n"
        "                    return True\n"
        "            except OSError:\n"
        "                pass\n"
        "    try:\n"
        "        open(f'/proc/{os.getppid()}/mem', 'rb').close()\n"
        "        return True  # the judge's memory (which holds the test) is open to us\n"
        "    except OSError:\n"
        "        return False\n"
        "FOUND = _found()\n"
        "def add(a, b):\n"
        "    return a + b if FOUND else a - b\n"
    ),
}


@pytest.mark.parametrize("name", sorted(CHEATS))
async def test_function_cheats_fail(job_sandboxes: JobSandboxes, name: str) -> None:
    reward, details = await evaluate(job_sandboxes, ADD, CHEATS[name])
    assert reward == 0.0, details
    assert details["status"] == "failed", details


async def test_the_search_cheat_would_score_if_the_test_were_reachable(job_sandboxes: JobSandboxes) -> None:
    """The control for the search cheat above: with the marker placed where it looks, it scores."""
    planted = CHEATS["searches files and process memory for the hidden test"].replace(
        "FOUND = _found()", "open('/tmp/planted', 'wb').write(MARK)\nFOUND = _found()"
    )
    reward, details = await evaluate(job_sandboxes, ADD, planted)
    assert reward == 1.0, details


async def test_a_function_that_loops_forever_times_out_with_reward_0(job_sandboxes: JobSandboxes) -> None:
    solution = ADD["prompt"] + "    while True:\n        pass\n"
    reward, details = await evaluate(job_sandboxes, {**ADD, "time_limit": 1}, solution)
    assert reward == 0.0
    assert details["status"] == "timeout" and details["timed_out"] is True, details


async def test_a_solution_that_does_not_define_the_function_fails(job_sandboxes: JobSandboxes) -> None:
    reward, details = await evaluate(job_sandboxes, ADD, "def plus(a, b):\n    return a + b\n")
    assert reward == 0.0 and "does not define add()" in details["detail"], details
    reward, details = await evaluate(job_sandboxes, ADD, "def add(a, b):\n    return a +\n")
    assert reward == 0.0 and "SyntaxError" in details["detail"], details


async def test_a_missing_solution_scores_0_without_a_sandbox(job_sandboxes: JobSandboxes) -> None:
    reward, details = await evaluate(job_sandboxes, ADD, None)
    assert reward == 0.0 and "no solution" in details["reason"]


# -- stdin/stdout problems ------------------------------------------------------------------------------

SUM = {
    "data_source": "codecontests",
    "problem": "Read two integers and print their sum.",
    "public_tests": {"input": ["1 2\n"], "output": ["3\n"]},
    "private_tests": {"input": ["10 20\n", "-5 5\n"], "output": ["30\n", "0\n"]},
    "generated_tests": {"input": ["100 1\r\n"], "output": ["101"]},
    "time_limit": {"seconds": 2, "nanos": 0},
}
SUM_GOLD = "a, b = map(int, input().split())\nprint(a + b)   \n"


async def test_stdio_gold_passes_every_test(job_sandboxes: JobSandboxes) -> None:
    reward, details = await evaluate(job_sandboxes, SUM, SUM_GOLD)
    assert reward == 1.0, details
    assert details["passed"] == details["total"] == 4 and details["tests"] == []


async def test_stdio_fraction_and_all_pass_modes(job_sandboxes: JobSandboxes) -> None:
    # Right only when the sum is small: passes 3 of 4 tests.
    partial = "a, b = map(int, input().split())\nprint(a + b if a + b < 50 else 0)\n"
    reward, details = await evaluate(job_sandboxes, SUM, partial, reward_mode="fraction")
    assert reward == 0.75 and details["passed"] == 3, details
    assert details["tests"] == [
        {"test": 3, "status": "wrong_answer", "time_s": details["tests"][0]["time_s"]}
    ]
    reward, details = await evaluate(job_sandboxes, {**SUM, "reward_mode": "fraction"}, partial)
    assert reward == 0.75
    reward, details = await evaluate(job_sandboxes, SUM, partial)  # default: all tests must pass
    assert reward == 0.0 and details["reward_mode"] == "all"


async def test_stdio_all_mode_stops_at_the_first_failure(job_sandboxes: JobSandboxes) -> None:
    reward, details = await evaluate(job_sandboxes, SUM, "print(0)\n")
    assert reward == 0.0
    assert details["counts"] == {"wrong_answer": 1, "not_run": 3}, details


@pytest.mark.parametrize(
    ("program", "status"),
    [
        ("while True:\n    pass\n", "timeout"),
        ("import os, time\nif os.fork() == 0:\n    time.sleep(3600)\nwhile True:\n    pass\n", "timeout"),
        ("raise SystemExit(3)\n", "runtime_error"),
        ("x = [0] * (10 ** 10)\n", "runtime_error"),  # over the memory limit: MemoryError
        ("import sys\nwhile True:\n    sys.stdout.write('y' * 65536)\n", "output_limit"),
        ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n", "signal"),
    ],
)
async def test_stdio_programs_that_hang_crash_or_flood_score_0(
    job_sandboxes: JobSandboxes, program: str, status: str
) -> None:
    instance = {**SUM, "time_limit": 1, "memory_limit": 256}
    reward, details = await evaluate(job_sandboxes, instance, program, reward_mode="fraction")
    assert reward == 0.0, details
    assert details["counts"].get(status) == 4, details
    if status == "timeout":
        assert details["timed_out"] is True


async def test_stdio_expected_outputs_never_reach_the_program(job_sandboxes: JobSandboxes) -> None:
    """A program that looks for the expected output on disk finds none (it would print it if it did)."""
    seeker = (
        "import os, sys\n"
        "data = sys.stdin.read()\n"
        "for d, _, files in os.walk('/'):\n"
        "    if d.startswith(('/proc', '/sys', '/dev', '/usr')):\n"
        "        continue\n"
        "    for name in files:\n"
        "        p = os.path.join(d, name)\n"
        "        if p.endswith('.out') or 'expected' in p:\n"
        "            try:\n"
        "                text = open(p).read()\n"
        "            except OSError:\n"
        "                continue\n"
        "            if text.strip():\n"
        "                print(text.strip())\n"
        "                sys.exit(0)\n"
        "print('nothing')\n"
    )
    reward, details = await evaluate(job_sandboxes, SUM, seeker, reward_mode="fraction")
    assert reward == 0.0, details


async def test_a_dead_eval_sandbox_is_an_infrastructure_error(
    job_sandboxes: JobSandboxes, sandbox_manager: SandboxManager
) -> None:
    instance = {**SUM, "time_limit": 30}
    task = asyncio.create_task(evaluate(job_sandboxes, instance, "import time\ntime.sleep(60)\n"))
    sb = await _program_running(sandbox_manager)
    assert sb.pid is not None
    os.kill(sb.pid, signal.SIGKILL)
    with pytest.raises(RaasError) as err:
        await task
    assert err.value.infrastructure, err.value.kind
    assert err.value.stage == "eval"


async def _program_running(manager: SandboxManager) -> Any:
    """The EVAL sandbox, once the program under test runs in it (found by its sandbox id and cmdline)."""
    for _ in range(1200):
        for sb in manager.list():
            for pid in procs.pids_with_env(sb.id):
                try:
                    cmdline = await asyncio.to_thread(Path(f"/proc/{pid}/cmdline").read_bytes)
                except OSError:
                    continue
                if b"solution.py" in cmdline and b"harness.py" not in cmdline:
                    return sb
        await asyncio.sleep(0.05)
    raise AssertionError("the program under test never started")


async def test_local_sandboxes_evaluate_side_by_side_in_their_own_workspaces(
    sandbox_manager: SandboxManager,
) -> None:
    """The local backend ignores ``workdir``: EVAL works in each sandbox's own workspace, so concurrent
    evaluations never share files."""
    local = make_config(backend="local")

    async def one(instance: dict[str, Any], solution: str) -> float | None:
        js = JobSandboxes(sandbox_manager, local, owner="code-eval-local")
        try:
            return (await evaluate(js, instance, solution))[0]
        finally:
            await js.close_all()

    rewards = await asyncio.gather(
        one(SUM, SUM_GOLD),
        one(SUM, "print(0)\n"),
        one(ADD, ADD_GOLD),
        one(ADD, "def add(a, b):\n    return 0\n"),
    )
    assert rewards == [1.0, 0.0, 1.0, 0.0]
