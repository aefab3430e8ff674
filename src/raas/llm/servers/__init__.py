"""raas.llm.servers."""
