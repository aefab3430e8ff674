"""raas: Rollout-as-a-Service.

Runs the whole rollout lifecycle of multi-turn LLM agents (sandboxes, tools, token-exact
generation, evaluation) outside the trainer and serves it over HTTP.
"""

__version__ = "0.1.0"
