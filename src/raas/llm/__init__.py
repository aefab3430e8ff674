"""raas.llm: token-exact chat templating, generate clients per server kind, the balancer, the embedded
llama.cpp server."""

from raas.llm.balancer import LLMBalancer
from raas.llm.routing import RoutingConfig
from raas.llm.template_check import TemplateReport, check_template
from raas.llm.tokenizer import ChatTokenizer, Conversation
from raas.llm.types import (
    ContextWindowExceeded,
    GenerateResult,
    LLMError,
    LLMUnavailable,
    SamplingParams,
    ServerInfo,
)

__all__ = [
    "ChatTokenizer",
    "ContextWindowExceeded",
    "Conversation",
    "GenerateResult",
    "LLMBalancer",
    "LLMError",
    "LLMUnavailable",
    "RoutingConfig",
    "SamplingParams",
    "ServerInfo",
    "TemplateReport",
    "check_template",
]
