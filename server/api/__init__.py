"""The OpenAI-compatible HTTP API of one pdserve server (FastAPI)."""

from server.api.app import create_app

__all__ = ["create_app"]
