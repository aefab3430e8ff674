"""raas.sandbox."""
