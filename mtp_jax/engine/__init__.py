"""Compiled programs (prefill, speculative round), pools, scheduler and the ``LLM`` face."""
