"""The built-in ``code`` task (HumanEval-style function problems and stdin/stdout problems)."""

from raas.tasks.code.handler import CodeHandler

__all__ = ["CodeHandler"]
