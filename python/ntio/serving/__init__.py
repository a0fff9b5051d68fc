"""`ntio serve`: an OpenAI-compatible server whose concurrent requests share each pass over the model.

- `scheduler`: continuous batching, one engine thread, slots with their own KV caches;
- `protocol`: OpenAI's request and response shapes, validation and errors (no web framework);
- `app`: the FastAPI app (the optional `serve` extra: fastapi, uvicorn).
"""
