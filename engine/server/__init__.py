"""The engine's HTTP server: an OpenAI-compatible API over one engine thread."""
