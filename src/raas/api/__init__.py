"""raas.api."""
