"""The built-in ``stem`` task (multiple-choice and short-answer science questions)."""

from raas.tasks.stem.handler import StemHandler

__all__ = ["StemHandler"]
