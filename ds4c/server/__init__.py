"""ds4c serve: an OpenAI-compatible HTTP server over :class:`ds4c.Model` (docs/serving.md).

Modules, one job each: ``protocol`` (OpenAI's request bodies and error objects), ``chat`` (a chat request -> the
DeepSeek-V4 prompt and how to read the reply), ``toolcalls`` (the reply's DSML tool calls and reasoning ->
OpenAI's fields, incrementally), ``engine`` (what the server asks of an engine; the one-sequence engine),
``scheduler`` (admission, queue, timeouts, cancellation, drain), ``metrics`` (Prometheus), ``app`` (the FastAPI
routes), ``launch`` (:func:`serve` / :func:`serve_model`: uvicorn, signals).
"""

from ds4c.server.launch import serve, serve_model

__all__ = ["serve", "serve_model"]
