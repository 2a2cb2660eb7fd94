"""The OpenAI-compatible HTTP server on the AsyncEngine."""

from server.app import create_app, serve

__all__ = ["create_app", "serve"]
