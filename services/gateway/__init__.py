"""The OpenAI-compatible HTTP gateway (``omniflow-gateway``)."""
