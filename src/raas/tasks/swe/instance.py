"""The SWE task records the handler accepts, read into one :class:`SweTask`.

Shapes (a record's ``data_source`` routes it to the handler; its fields decide how it is graded):

* **SWE-bench / SWE-Gym** (``instance_id, repo, base_commit, problem_statement, test_patch, FAIL_TO_PASS,
  PASS_TO_PASS, version, environment_setup_commit``; the lists may be JSON-encoded strings, as on the
  hubs). Graded by ``test_cmd`` + ``log_parser`` when the record names them (records built by
  ``raas swe build``, docs/swe-records.md), by its ``eval_script`` (+ ``log_parser``) when it carries one
  (SWE-bench 5 task repos), else by the command and parser SWE-bench's conventions give for ``repo``
  (:mod:`.specs`).
* **R2E-Gym** (``docker_image``, ``problem_statement``, ``expected_output_json``; the image holds the repo
  at ``/testbed``, its ``run_tests.sh`` and the hidden tests in ``/r2e_tests``): graded by running
  ``run_tests.sh`` and comparing with ``expected_output_json`` (:mod:`.r2e`).

Every problem is a ``bad_request`` that names the field, raised at submit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from raas.errors import RaasError

from . import specs

Grading = Literal["test_cmd", "eval_script", "r2e"]
R2E_HIDDEN = ("/r2e_tests", "/testbed/run_tests.sh", "/testbed/r2e_tests")
"""Where R2E-Gym images keep what the policy must not see: the hidden tests and the script that runs them
(R2E-Gym moves them out of the repository before the agent starts, too)."""


def _json_value(v: Any) -> Any:
    if isinstance(v, str):
        try:
            return json.loads(v)
        except ValueError as e:
            raise ValueError(f"not valid JSON: {e}") from e
    return v


def _absolute(v: str) -> str:
    if not v.startswith("/") or "\0" in v:
        raise ValueError("must be an absolute path")
    return v


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    problem_statement: str = Field(min_length=1)
    image: str | None = Field(None, min_length=1)
    workdir: str = "/testbed"
    test_cmd: str | None = Field(None, min_length=1)
    hidden_paths: list[str] | None = None

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str) -> str:
        return _absolute(v)

    @field_validator("hidden_paths")
    @classmethod
    def _hidden(cls, v: list[str] | None) -> list[str] | None:
        return None if v is None else [_absolute(p) for p in v]


class SweBenchRecord(_Common):
    instance_id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._+@=-]*$")
    repo: str = Field(min_length=1)
    base_commit: str = Field(pattern=r"^[0-9a-f]{7,40}$")
    test_patch: str = ""
    """Empty: the tests are already in the repository at the base commit; EVAL applies no test patch."""
    FAIL_TO_PASS: list[str] = Field(min_length=1)
    PASS_TO_PASS: list[str]
    version: str = ""
    environment_setup_commit: str | None = None
    log_parser: str | None = Field(None, min_length=1)
    eval_script: str | None = Field(None, min_length=1)
    eval_type: Literal["pass_and_fail", "fail_only"] = "pass_and_fail"

    @field_validator("FAIL_TO_PASS", "PASS_TO_PASS", mode="before")
    @classmethod
    def _lists(cls, v: Any) -> Any:
        return _json_value(v)

    @field_validator("version", mode="before")
    @classmethod
    def _version(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v

    @field_validator("test_patch", mode="before")
    @classmethod
    def _diff(cls, v: Any) -> Any:
        if v is None or (isinstance(v, str) and not v.strip()):
            return ""
        if isinstance(v, str) and "diff --git " not in v:
            raise ValueError("must be a git diff (no 'diff --git' header)")
        return v


class R2ERecord(_Common):
    docker_image: str | None = Field(None, min_length=1)
    expected_output_json: dict[str, str]
    instance_id: str | None = None
    repo_name: str | None = None
    commit_hash: str | None = None
    run_tests: str | None = Field(
        None, min_length=1, description="run_tests.sh's content, if not in the image"
    )

    @field_validator("expected_output_json", mode="before")
    @classmethod
    def _expected(cls, v: Any) -> Any:
        return _json_value(v)


@dataclass
class SweTask:
    """One instance, whatever shape it came in, as the handler runs it."""

    instance_id: str
    repo: str
    problem_statement: str
    grading: Grading
    image: str | None
    """An explicit image reference (rootfs dir, SIF, ``docker://``, ``docker-archive:``); None: by naming."""
    workdir: str = "/testbed"
    base_commit: str | None = None
    """None (R2E): the repository's HEAD in the image is the base."""
    test_patch: str = ""
    fail_to_pass: list[str] = field(default_factory=list)
    pass_to_pass: list[str] = field(default_factory=list)
    version: str = ""
    test_cmd: str | None = None
    log_parser: str | None = None
    eval_script: str | None = None
    eval_type: str = "pass_and_fail"
    expected_output: dict[str, str] = field(default_factory=dict)
    run_tests: str | None = None
    hidden_paths: list[str] = field(default_factory=list)
    """Absolute paths in the image removed from the RUN sandbox before the policy starts."""
    derived: bool = False
    """The test command and parser come from SWE-bench's conventions, not from the record."""

    @property
    def protected_files(self) -> list[str]:
        """Repository paths the model's patch must not touch: the files ``test_patch`` writes, and hidden
        paths inside the repository. They are left out of the extracted patch."""
        out = specs.test_patch_files(self.test_patch)
        prefix = self.workdir.rstrip("/") + "/"
        out += [p[len(prefix) :] for p in self.hidden_paths if p.startswith(prefix)]
        return out

    def grading_record(self) -> dict[str, Any]:
        """The record in the shape :mod:`.runner` and :mod:`.grading` read."""
        return {
            "instance_id": self.instance_id,
            "repo": self.repo,
            "version": self.version,
            "image": self.image or "",
            "workdir": self.workdir,
            "test_patch": self.test_patch,
            "test_cmd": self.test_cmd,
            "log_parser": self.log_parser,
            "eval_type": self.eval_type,
            "FAIL_TO_PASS": self.fail_to_pass,
            "PASS_TO_PASS": self.pass_to_pass,
        }


def _invalid(e: ValidationError) -> RaasError:
    first = e.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or "record"
    return RaasError(f"invalid SWE record field {loc}: {first['msg']}", kind="bad_request")


def is_r2e(instance: dict[str, Any]) -> bool:
    return "expected_output_json" in instance and "FAIL_TO_PASS" not in instance


def parse_task(instance: dict[str, Any]) -> SweTask:
    """Read any accepted shape; ``bad_request`` naming the field that is wrong."""
    if not isinstance(instance, dict):
        raise RaasError("a SWE record must be a JSON object", kind="bad_request")
    try:
        return _r2e(R2ERecord.model_validate(instance)) if is_r2e(instance) else _swebench(instance)
    except ValidationError as e:
        raise _invalid(e) from e


def _swebench(instance: dict[str, Any]) -> SweTask:
    rec = SweBenchRecord.model_validate(instance)
    task = SweTask(
        instance_id=rec.instance_id,
        repo=rec.repo,
        problem_statement=rec.problem_statement,
        grading="test_cmd",
        image=rec.image,
        workdir=rec.workdir,
        base_commit=rec.base_commit,
        test_patch=rec.test_patch,
        fail_to_pass=list(rec.FAIL_TO_PASS),
        pass_to_pass=list(rec.PASS_TO_PASS),
        version=rec.version,
        test_cmd=rec.test_cmd,
        log_parser=rec.log_parser,
        eval_type=rec.eval_type,
        hidden_paths=list(rec.hidden_paths or []),
    )
    if rec.test_cmd is None and rec.eval_script is not None:
        task.grading, task.eval_script = "eval_script", rec.eval_script
    elif rec.test_cmd is None:
        task.test_cmd = specs.derive_test_cmd(rec.repo, rec.version, rec.test_patch)
        if task.test_cmd is None:
            raise RaasError(
                f"invalid SWE record field test_cmd: the record names no test_cmd or eval_script, and "
                f"SWE-bench has no test command for repo {rec.repo!r}; add test_cmd and log_parser",
                kind="bad_request",
            )
        task.derived = True
    if task.log_parser is None:
        task.log_parser = specs.parser_for_repo(rec.repo)
        if task.log_parser is None:
            raise RaasError(
                f"invalid SWE record field log_parser: missing, and SWE-bench has no log parser for repo "
                f"{rec.repo!r}",
                kind="bad_request",
            )
    from . import grading

    if not grading.known_parser(task.log_parser):
        raise RaasError(
            f"invalid SWE record field log_parser: {task.log_parser!r} is not a SWE-bench log parser",
            kind="bad_request",
        )
    return task


def _r2e(rec: R2ERecord) -> SweTask:
    image = rec.image
    if image is None and rec.docker_image is not None:
        image = rec.docker_image if "://" in rec.docker_image else f"docker://{rec.docker_image}"
    if image is None:
        raise RaasError(
            "invalid SWE record field docker_image: an R2E-Gym record needs docker_image (or image)",
            kind="bad_request",
        )
    if not rec.expected_output_json:
        raise RaasError("invalid SWE record field expected_output_json: no tests in it", kind="bad_request")
    ident = rec.instance_id or f"{rec.repo_name or 'r2e'}-{(rec.commit_hash or image)[-12:]}"
    return SweTask(
        instance_id=ident,
        repo=rec.repo_name or "",
        problem_statement=rec.problem_statement,
        grading="r2e",
        image=image,
        workdir=rec.workdir,
        test_cmd=rec.test_cmd,
        expected_output=dict(rec.expected_output_json),
        run_tests=rec.run_tests,
        hidden_paths=list(rec.hidden_paths if rec.hidden_paths is not None else R2E_HIDDEN),
    )
