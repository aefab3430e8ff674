"""raas.sandbox: run tool servers in sandboxes (local, bwrap, apptainer, docker/podman) and own them."""

from raas.sandbox.base import Sandbox, backend_class
from raas.sandbox.config import SandboxConfig, config_from_dict, make_config
from raas.sandbox.manager import SandboxManager

__all__ = [
    "Sandbox",
    "SandboxConfig",
    "SandboxManager",
    "backend_class",
    "config_from_dict",
    "make_config",
]
