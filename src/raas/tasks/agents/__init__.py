"""Agents the ``harness`` task ships as files to run inside sandboxes (not imported by raas itself)."""
