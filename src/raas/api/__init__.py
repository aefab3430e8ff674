"""raas.api: the HTTP face of the rollout service (native /v1 routes and ProRL-compatible routes)."""

from raas.api.app import create_app, serve, served

__all__ = ["create_app", "serve", "served"]
