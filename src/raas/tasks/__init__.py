"""raas.tasks."""
