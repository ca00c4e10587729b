"""ds4c serve: an OpenAI-compatible HTTP server over ds4c.Model (docs/serving.md)."""
