"""Helpers for tests, benchmarks and the demo: tiny generated models, a real vLLM server process."""
