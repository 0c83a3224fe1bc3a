"""A failed leg of a routed request, raised by the leg picker (queue.py) and the legs (legs.py)."""

from __future__ import annotations

from server.openai.errors import error_body


class LegError(Exception):
    def __init__(self, status: int, message: str, body: dict | None = None, *, untouched: bool = False,
                 lost: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.body = body or error_body(status, message)
        self.untouched = untouched  # the server never took the request (unreachable, draining): try another
        self.lost = lost  # the connection broke after the server took the request (it died)

        self.server: str | None = None  # the server of the leg that failed, where one was booked

    def of_leg(self, leg: str, server: str) -> LegError:
        """The same failure, its message naming the leg and the server (a server's own 4xx body kept)."""
        message = str(self)
        if not message.startswith(f"{leg} leg failed"):
            message = f"{leg} leg failed: {message}"
        error = LegError(self.status, message, self.body if self.status < 500 else None, untouched=self.untouched,
                         lost=self.lost)
        error.server = server
        return error
