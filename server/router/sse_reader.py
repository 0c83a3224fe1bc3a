"""The router's one SSE parser: a server's stream cut into whole events, as bytes (for the early
context answer and the relay of a generation leg that may move)."""

from __future__ import annotations

from server.openai.wire import loads

END = b"\n\n"


class EventSplitter:
    """Feed it chunks as they arrive; it returns the complete events so far (a partial event waits)."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> bytes:
        """The complete events received so far, each ending with a blank line (b"" if none)."""
        buffer = self._buffer + chunk
        end = buffer.rfind(END)
        if end < 0:
            self._buffer = buffer
            return b""
        self._buffer = buffer[end + 2:]
        return buffer[:end + 2]


def split_events(complete: bytes) -> list[bytes]:
    """Complete events (what `EventSplitter.feed` returned) one by one, without their blank line."""
    return complete[:-2].split(END) if complete else []


def event_data(event: bytes) -> object | None:
    """The JSON value of an event's `data:` lines (None for `[DONE]` or an event without data)."""
    data = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
    return None if data in (b"", b"[DONE]") else loads(data)
