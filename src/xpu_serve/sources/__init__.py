"""Live sources: vLLM output, kernel log, processes, health."""
