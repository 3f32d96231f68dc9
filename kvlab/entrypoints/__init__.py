"""How users reach the engine from outside Python, as vLLM's entrypoints: `kvlab serve`, an OpenAI-compatible server."""
