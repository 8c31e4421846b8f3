"""The OpenAI-compatible HTTP gateway."""
