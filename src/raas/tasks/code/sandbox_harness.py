"""The code task's evaluation harness: runs *inside* a fresh evaluation sandbox on the image's own python3.

Stdlib only, Python >= 3.8 (like the tool server). Two commands, each reading a JSON spec file:

``run SPEC`` (stdin/stdout problems)
    Runs ``python3 -I SOLUTION`` once per test input, each in a session of its own under an address-space
    limit, a file-size limit and a wall-clock timeout; the program's stdout goes to the test's output file
    (cut at the spec's cap), and one status per test (``ok``, ``error``, ``timeout``, ``signal``,
    ``output_limit``) goes to the results file. Expected outputs are never given to it: the host compares.
    With ``stop_on_error`` it stops at the first test that did not exit cleanly.

``judge SPEC`` (function problems, HumanEval's ``check(candidate)``)
    The spec file (hidden test, nonce) is deleted as soon as it is read. The candidate's code runs in a
    child process; this process calls it through a pipe, passing arguments and results as Python literals
    (``repr`` / ``ast.literal_eval``: nothing the child sends is ever executed here) and makes itself
    non-dumpable, so the candidate can read neither the test's source nor this process's memory, and
    cannot print a verdict (it does not know the nonce). Prints one line ``RAAS-VERDICT <nonce> <json>``.

Neither is a security boundary beyond that (the sandbox is): a program that kills this process only
fails its own tests.
"""

import ast
import json
import os
import resource
import select
import signal
import struct
import subprocess
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

VERDICT = "RAAS-VERDICT"
MAX_FRAME = 64 * 1024 * 1024
STDERR_TAIL = 400


def _no_dump() -> None:
    """Make this process non-dumpable: same-uid processes can no longer read its memory or fds."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except Exception:
        pass


def _lower(which: int, wanted: int) -> None:
    """Set a resource limit to ``wanted``, never above what the sandbox already allows."""
    _soft, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        wanted = min(wanted, hard)
    resource.setrlimit(which, (wanted, wanted))


def _limits(memory_mb: int, file_bytes: int) -> Callable[[], None]:
    def apply() -> None:
        _lower(resource.RLIMIT_AS, memory_mb * 1024 * 1024)
        _lower(resource.RLIMIT_FSIZE, file_bytes)
        _lower(resource.RLIMIT_CORE, 0)

    return apply


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: str, limit: int = STDERR_TAIL) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


# -- run: stdin/stdout tests ----------------------------------------------------------------------------


def run_tests(spec: Dict[str, Any]) -> None:
    results = []  # type: List[Dict[str, Any]]
    timeout = float(spec["timeout"])
    memory_mb = int(spec["memory_mb"])
    workdir = spec["workdir"]
    os.makedirs(workdir, exist_ok=True)
    for test in spec["tests"]:
        cap = int(test["cap"])
        err_path = test.get("stderr") or test["output"] + ".err"
        os.makedirs(os.path.dirname(test["output"]), exist_ok=True)
        started = time.monotonic()
        fin = open(test["input"], "rb")
        fout = open(test["output"], "wb")
        ferr = open(err_path, "wb")
        try:
            proc = subprocess.Popen(
                [sys.executable, "-I", spec["solution"]],
                stdin=fin,
                stdout=fout,
                stderr=ferr,
                cwd=workdir,
                start_new_session=True,
                preexec_fn=_limits(memory_mb, max(cap + 1, 1024 * 1024)),
            )
            try:
                rc = proc.wait(timeout=timeout)
                status = "ok" if rc == 0 else ("error" if rc > 0 else "signal")
            except subprocess.TimeoutExpired:
                _kill_group(proc.pid)
                rc = proc.wait()
                status = "timeout"
        finally:
            for f in (fin, fout, ferr):
                f.close()
        elapsed = time.monotonic() - started
        _kill_group(proc.pid)  # whatever it left running in its session
        if rc == -signal.SIGXFSZ or os.path.getsize(test["output"]) > cap:
            status = "output_limit"
            with open(test["output"], "r+b") as out:
                out.truncate(cap + 1)
        results.append(
            {
                "id": test["id"],
                "status": status,
                "rc": rc,
                "time_s": round(elapsed, 4),
                "stderr": _tail(err_path),
            }
        )
        if spec.get("stop_on_error") and status != "ok":
            break
    tmp = spec["results"] + ".tmp"
    with open(tmp, "w") as dest:
        json.dump(results, dest)
    os.replace(tmp, spec["results"])


# -- judge: check(candidate) with the candidate in a child process --------------------------------------


class CandidateError(Exception):
    """The candidate's code raised, returned something that is not a plain value, or its process died."""


class Timeout(Exception):
    pass


def _send(fd: int, obj: Any) -> None:
    data = repr(obj).encode("utf-8")
    os.write(fd, struct.pack(">Q", len(data)))
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _read_exact(fd: int, n: int, deadline: Optional[float]) -> bytes:
    chunks = []
    while n > 0:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise Timeout()
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            raise EOFError()
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _recv(fd: int, deadline: Optional[float] = None) -> str:
    (n,) = struct.unpack(">Q", _read_exact(fd, 8, deadline))
    if n > MAX_FRAME:
        raise CandidateError("the candidate sent a value larger than %d bytes" % MAX_FRAME)
    return _read_exact(fd, n, deadline).decode("utf-8", "replace")


class Candidate:
    """Stands in for the candidate function inside ``check``: each call runs in the child process."""

    def __init__(
        self, proc: "subprocess.Popen[bytes]", to_child: int, from_child: int, deadline: float
    ) -> None:
        self.proc, self.to_child, self.from_child, self.deadline = proc, to_child, from_child, deadline
        self.calls = 0

    def _exchange(self, message: Tuple[Any, ...]) -> Tuple[Any, ...]:
        try:
            _send(self.to_child, message)
            raw = _recv(self.from_child, self.deadline)
        except (EOFError, BrokenPipeError):
            raise CandidateError("the candidate's process exited (code %s)" % (self.proc.poll(),)) from None
        try:
            reply = ast.literal_eval(raw)
        except Exception:
            raise CandidateError("the candidate's process sent an unreadable reply") from None
        if not isinstance(reply, tuple) or not reply:
            raise CandidateError("the candidate's process sent an unreadable reply")
        return reply

    def load(self, prompt: str, solution: str, entry_point: str) -> None:
        reply = self._exchange(("load", prompt, solution, entry_point))
        if reply[0] != "loaded":
            raise CandidateError(str(reply[1]) if len(reply) > 1 else "the solution did not load")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        try:
            repr_ok = ast.literal_eval(repr((args, kwargs))) == (args, kwargs)
        except Exception:
            repr_ok = False
        if not repr_ok:
            raise CandidateError("the test passes a value that cannot cross to the candidate's process")
        reply = self._exchange(("call", args, kwargs))
        if reply[0] == "ok" and len(reply) == 2:
            return reply[1]
        raise CandidateError(str(reply[1]) if len(reply) > 1 else "the call failed")


def child_main(rfd: int, wfd: int, memory_mb: int) -> None:
    """The candidate's side: load the solution, then answer calls until the pipe closes."""
    _lower(resource.RLIMIT_AS, memory_mb * 1024 * 1024)
    _lower(resource.RLIMIT_CORE, 0)
    fn = None  # type: Optional[Callable[..., Any]]
    while True:
        try:
            message = ast.literal_eval(_recv(rfd))
        except EOFError:
            return
        if message[0] == "load":
            _, prompt, solution, entry_point = message
            ns = {"__name__": "__solution__", "__builtins__": __builtins__}  # type: Dict[str, Any]
            try:
                with open(solution, "rb") as f:
                    source = f.read().decode("utf-8", "replace")
                # The prompt first, as HumanEval runs prompt + completion: its imports and helpers are there
                # for a solution that restates only the function.
                exec(compile(prompt, "<prompt>", "exec"), ns)
                stub = ns.get(entry_point)
                exec(compile(source, solution, "exec"), ns)
                fn = ns.get(entry_point)
                if not callable(fn) or fn is stub:
                    raise NameError("the solution does not define %s()" % entry_point)
                reply = ("loaded",)  # type: Tuple[Any, ...]
            except BaseException as exc:  # SystemExit included: a solution that exits has not loaded
                reply = ("load_error", "%s: %s" % (type(exc).__name__, str(exc)[:300]))
        else:
            _, args, kwargs = message
            try:
                if fn is None:
                    raise RuntimeError("called before the solution loaded")
                value = fn(*args, **kwargs)
                text = repr(value)
                ast.literal_eval(text)
                reply = ("ok", value)
            except BaseException as exc:
                reply = ("raise", "%s: %s" % (type(exc).__name__, str(exc)[:300]))
        try:
            _send(wfd, reply)
        except Exception:
            _send(wfd, ("raise", "the result is not a plain value (numbers, strings, lists, tuples, dicts)"))


def _failure_detail(exc: BaseException) -> str:
    """Where in the hidden test an assertion failed (line number and source line)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == "<test>"]
    if not frames:
        return "%s: %s" % (type(exc).__name__, str(exc)[:300])
    return "%s at line %s of the test" % (type(exc).__name__, frames[-1].lineno)


def judge(spec: Dict[str, Any]) -> None:
    nonce = spec["nonce"]
    os.makedirs(spec["workdir"], exist_ok=True)
    deadline = time.monotonic() + float(spec["timeout"])
    _no_dump()
    to_child_r, to_child_w = os.pipe()
    from_child_r, from_child_w = os.pipe()
    devnull = os.open(os.devnull, os.O_RDWR)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-I",
            os.path.abspath(__file__),
            "child",
            str(to_child_r),
            str(from_child_w),
            str(spec["memory_mb"]),
        ],
        stdin=devnull,
        stdout=devnull,
        stderr=devnull,
        pass_fds=(to_child_r, from_child_w),
        cwd=spec["workdir"],
        start_new_session=True,
    )
    os.close(to_child_r)
    os.close(from_child_w)
    os.close(devnull)
    candidate = Candidate(proc, to_child_w, from_child_r, deadline)
    verdict = {"status": "failed", "detail": ""}  # type: Dict[str, Any]
    try:
        ns = {"__name__": "__check__"}  # type: Dict[str, Any]
        exec(compile(spec["prompt"], "<prompt>", "exec"), ns)
        exec(compile(spec["test"], "<test>", "exec"), ns)
        # As in HumanEval's prompt + completion + test: the entry point's name means the candidate there too.
        ns[spec["entry_point"]] = candidate
        candidate.load(spec["prompt"], spec["solution"], spec["entry_point"])
        ns["check"](candidate)
        verdict = {"status": "passed", "detail": "check(candidate) returned"}
    except Timeout:
        verdict = {"status": "timeout", "detail": "the candidate ran past %ss" % spec["timeout"]}
    except CandidateError as exc:
        verdict = {"status": "failed", "detail": str(exc)}
    except BaseException as exc:
        verdict = {"status": "failed", "detail": _failure_detail(exc)}
    finally:
        _kill_group(proc.pid)
        proc.wait()
    verdict["calls"] = candidate.calls
    sys.stdout.write("%s %s %s\n" % (VERDICT, nonce, json.dumps(verdict)))
    sys.stdout.flush()


def main(argv: List[str]) -> int:
    if argv[1] == "child":
        child_main(int(argv[2]), int(argv[3]), int(argv[4]))
        return 0
    with open(argv[2]) as f:
        spec = json.load(f)
    if argv[1] == "judge":
        os.unlink(argv[2])
        judge(spec)
    elif argv[1] == "run":
        run_tests(spec)
    else:
        sys.stderr.write("unknown command %r\n" % argv[1])
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
