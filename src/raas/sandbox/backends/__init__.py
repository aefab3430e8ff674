"""raas.sandbox.backends."""
