"""OpenAI-compatible HTTP server on one shared engine."""
