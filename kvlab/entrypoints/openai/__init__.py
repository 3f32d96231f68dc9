"""The OpenAI-compatible HTTP server: request schemas (protocol), the chat template, the FastAPI app (api_server)."""
