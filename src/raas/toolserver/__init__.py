"""raas.toolserver."""
