"""Server-sent events framing shared by the servers and the router.

An event is `data: <json>\\n\\n`. JSON may carry U+0085 (NEL), U+2028 and U+2029 raw inside strings,
but clients that split a stream with `str.splitlines()` (httpx's `aiter_lines()`, and so every
client built on it) treat them as line ends and cut the event in two. They are escaped here
(`\\u2028` inside a JSON string is the same string), so a data line holds no character any client
reads as a line break. Control characters below U+0020 are escaped by every JSON encoder already.
"""

from __future__ import annotations

LINE_BREAKS = "\u0085\u2028\u2029"
_ESCAPE = str.maketrans({ch: f"\\u{ord(ch):04x}" for ch in LINE_BREAKS})


def escape_line_breaks(data: str) -> str:
    """`data` (JSON text) with every U+0085/U+2028/U+2029 written as its JSON escape."""
    if any(ch in data for ch in LINE_BREAKS):
        return data.translate(_ESCAPE)
    return data


def sse_event(data: str) -> bytes:
    """One SSE event carrying `data` (JSON text or `[DONE]`)."""
    return f"data: {escape_line_breaks(data)}\n\n".encode()
