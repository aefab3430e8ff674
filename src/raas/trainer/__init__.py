"""raas.trainer."""
