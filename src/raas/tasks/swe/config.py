"""Settings of the SWE task handler: images, sandbox sizing, the agent's prompt and tools, evaluation.

Defaults fit SWE-bench-sized repositories on a shared node. Change them with a JSON or TOML file named by
``RAAS_SWE_CONFIG`` (read when the service builds the handler), or in a subclass
(``config = SweConfig(...)``) registered through ``ServiceConfig.extra_handlers``.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from raas.errors import RaasError

from .images import DEFAULT_IMAGE_TEMPLATE

CONFIG_ENV = "RAAS_SWE_CONFIG"

AGENT_DEFAULTS: dict[str, int] = {"max_turns": 30, "max_tokens_per_turn": 1024, "context_budget": 8192}
"""The agent settings ``raas run`` uses for SWE jobs unless told otherwise. The initial prompt (system
prompt, tool schemas, the issue in :data:`PROMPT_TEMPLATE`) is about 850 tokens with the embedded model's
chat tokenizer plus the issue itself (860-1,500 tokens in all on the bundled records): 8,192 (the embedded
model's own context length) leaves over 6,500 tokens for edits and tool output, 1,024 tokens a turn fit a
tool call that rewrites a function, and 30 turns are a ceiling (the context budget usually ends a rollout
first)."""

SYSTEM_PROMPT = (
    "You are a software engineer working in a sandbox with a code repository. Use the bash tool to "
    "explore and run code and the str_replace_editor tool to view and edit files. When the change is "
    "complete, call the submit tool."
)

PROMPT_TEMPLATE = """<uploaded_files>
{workdir}
</uploaded_files>
I've uploaded a code repository in the directory {workdir}. Consider the following issue description:

<issue_description>
{problem_statement}
</issue_description>

Implement the necessary changes to the repository so that the requirements in the <issue_description> \
are met. Changes to test files are already taken care of, so you do not have to modify any tests. Make \
minimal changes to non-test files in {workdir}. When you are done, call the submit tool."""


class SweConfig(BaseModel):
    """See the module docstring; every field is documented in the README ("The SWE task")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    image_template: str = Field(
        DEFAULT_IMAGE_TEMPLATE,
        description="image of a record without one: {name} = SWE-bench's sweb.eval.x86_64.<id>:latest name, "
        "{instance_id} = the id",
    )
    starts_per_image: int = Field(4, ge=1, description="sandboxes of one image starting at once")
    starts_per_node: int = Field(16, ge=1, description="sandboxes of this handler starting at once")
    prewarm: bool = Field(True, description="start EVAL's fresh sandbox while RUN is still going")
    share_init: bool = Field(
        False,
        description="samples of one instance share INIT's repository preparation (the service's "
        "group_layers): one throwaway sandbox prepares, every sample starts from the prepared layer; "
        "off by default: on the measured instances it costs more than it saves (README)",
    )

    tmpfs_max_repo_mb: float = Field(
        300.0,
        ge=0,
        description="repositories up to this size get a RAM (tmpfs) writable area, larger on disk",
    )
    disk_mb_base: int = Field(1024, ge=64, description="tmpfs writable area: this much ...")
    disk_mb_per_repo_mb: float = Field(2.0, ge=1, description="... plus this many MB per MB of repository")
    memory_mb: int | None = Field(8192, gt=0, description="RLIMIT_AS of every process in the sandbox")
    max_procs: int | None = Field(1024, gt=0)
    start_timeout_s: float = Field(300.0, gt=0, description="a sandbox start (copies the repository)")
    command_timeout_s: float = Field(600.0, gt=0, description="default limit of one command in a sandbox")

    tools: list[str] = Field(
        default_factory=lambda: ["bash", "str_replace_editor", "submit"],
        description="the agent's tools (add 'ipython' for images with ipykernel)",
    )
    system_prompt: str = SYSTEM_PROMPT
    prompt_template: str = Field(PROMPT_TEMPLATE, description="{problem_statement}, {workdir}, {instance_id}")

    patch_cap_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="a larger patch is not evaluated (patch_too_large, reward 0)"
    )
    run_empty_patch: bool = Field(
        False, description="run the tests for an empty patch (else reward 0 at once)"
    )
    test_timeout_s: float = Field(1800.0, gt=0, description="limit of the test run in EVAL")
    test_log_cap_bytes: int = Field(65536, ge=1024, description="test log kept in the result (head + tail)")


def load_config(path: str | os.PathLike[str] | None = None) -> SweConfig:
    """The settings from ``path`` (or ``$RAAS_SWE_CONFIG``), else the defaults."""
    source = path if path is not None else os.environ.get(CONFIG_ENV)
    if not source:
        return SweConfig()
    p = Path(source)
    try:
        text = p.read_text()
        data = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
        return SweConfig.model_validate(data)
    except (OSError, ValueError, ValidationError) as e:
        raise RaasError(f"cannot read the SWE handler config {p}: {e}", kind="bad_request") from e
