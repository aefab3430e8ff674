"""What a RUN stage needs to talk to the policy: the balancer, the chat tokenizer and the agent settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from raas.agent.config import AgentConfig
from raas.errors import RaasError

if TYPE_CHECKING:
    from raas.llm import ChatTokenizer, LLMBalancer


@dataclass
class LLMContext:
    """Everything the RUN stage needs to talk to the policy.

    ``tokenizer`` is None in a service started without one; a handler that needs it says so with
    ``TaskHandler.needs_tokenizer`` (the service then refuses its jobs at submit) and reads it through
    :meth:`require_tokenizer`."""

    balancer: LLMBalancer
    tokenizer: ChatTokenizer | None
    agent: AgentConfig
    gateway: Any = None
    """The service's agent gateway (a :class:`raas.gateway.Gateway`, a layer above this one), for handlers
    that run third-party agents; None outside a service (such a handler then makes its own)."""

    def require_tokenizer(self) -> ChatTokenizer:
        """The chat tokenizer, or a typed error that says how to give the service one."""
        if self.tokenizer is None:
            raise RaasError(
                "this service has no chat tokenizer: start it with --tokenizer DIR (tokenizer_dir in the "
                "config) or pass tokenizer= to RolloutService",
                kind="handler_error",
                stage="run",
            )
        return self.tokenizer
