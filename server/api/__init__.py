"""The OpenAI-compatible HTTP API of one pdserve server (FastAPI)."""
