"""raas.agent."""
