"""A failed leg of a routed request, raised by the leg picker (queue.py) and the orchestrator."""

from __future__ import annotations

from server.openai.errors import error_body


class LegError(Exception):
    def __init__(self, status: int, message: str, body: dict | None = None, *, untouched: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.body = body or error_body(status, message)
        self.untouched = untouched  # the server never took the request (unreachable, draining): try another
        self.lost = False  # the connection broke after the server took the request (it died)
