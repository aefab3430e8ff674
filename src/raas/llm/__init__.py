"""raas.llm."""
