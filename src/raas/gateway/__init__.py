"""raas.gateway: run unmodified agents (OpenAI/Anthropic SDKs, LiteLLM, mini-swe-agent) against the policy
and record their exact tokens. OpenAI Chat Completions, OpenAI Responses and Anthropic Messages endpoints
per rollout, rendered with the policy's chat template into token IDs (append-only where the conversation
continues), generated token-in/token-out through the balancer (streamed where the server can), and reconstructed into
segments. Agents outside raas open and close rollouts of their own (:mod:`raas.gateway.external`)."""

from raas.gateway.gateway import Gateway, gateway_env
from raas.gateway.messages import ChatRequest
from raas.gateway.session import Completion, GatewaySession

__all__ = ["ChatRequest", "Completion", "Gateway", "GatewaySession", "gateway_env"]
