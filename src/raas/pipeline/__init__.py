"""raas.pipeline."""
