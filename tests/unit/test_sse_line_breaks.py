"""SSE data lines never hold U+0085 / U+2028 / U+2029 raw.

httpx's `iter_lines`/`aiter_lines` split on every line end `str.splitlines()` knows, these three
included; an event whose JSON carried one raw was cut in two there. Both the servers' SSE
(server/api/generation.py) and the router's own events (server/router/answers.py) escape them.
"""

from __future__ import annotations

import json

import httpx
from fastapi.testclient import TestClient
from test_api_engine_fake import FakeEngine, deployment_app

from server.openai.sse import LINE_BREAKS, escape_line_breaks, sse_event
from server.router.answers import closing_events, opening_events
from server.types import GenerateRequest

ODD_TEXT = "a\u2028b\u2029c\u0085d"  # each of the three between letters


class LineBreakEngine(FakeEngine):
    """Streams ODD_TEXT one character per output."""

    async def _outputs(self, req: GenerateRequest):
        for i, ch in enumerate(ODD_TEXT):
            last = i == len(ODD_TEXT) - 1
            yield self._output(req, self.tokenizer.encode(ch), ch, i + 1,
                               **({"finish_reason": "length"} if last else {}))


def data_lines(raw: bytes) -> list[str]:
    """The `data:` lines as httpx's line splitter (the one of `aiter_lines`) cuts them."""
    decoder = httpx._decoders.LineDecoder()
    lines = decoder.decode(raw.decode()) + decoder.flush()
    return [line.removeprefix("data: ") for line in lines if line]


def test_escaped_json_is_the_same_json():
    raw = json.dumps({"text": ODD_TEXT}, ensure_ascii=False)
    assert any(ch in raw for ch in LINE_BREAKS)
    escaped = escape_line_breaks(raw)
    assert not any(ch in escaped for ch in LINE_BREAKS)
    assert json.loads(escaped) == {"text": ODD_TEXT}
    assert sse_event("[DONE]") == b"data: [DONE]\n\n"


def test_server_sse_splits_into_whole_events_and_keeps_the_text():
    engine = LineBreakEngine()
    with TestClient(deployment_app(lambda: engine)) as client:
        for route, body, text_of in (
            ("/v1/completions", {"prompt": "hi", "max_tokens": 8, "stream": True},
             lambda c: c["choices"][0]["text"]),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stream": True},
             lambda c: c["choices"][0]["delta"].get("content") or ""),
        ):
            with client.stream("POST", route, json=body) as response:
                assert response.status_code == 200
                lines = list(response.iter_lines())  # httpx's line splitter
            events = [line.removeprefix("data: ") for line in lines if line]
            assert all(line.startswith("data: ") for line in lines if line), lines
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e) for e in events[:-1]]  # every line is one whole JSON event
            assert "".join(text_of(c) for c in chunks) == ODD_TEXT


def test_router_events_escape_line_breaks():
    model = "tiny\u2028model\u0085"
    ctx = {"id": "cmpl-1", "model": model, "created": 1,
           "choices": [{"text": ODD_TEXT, "finish_reason": None,
                        "disaggregated_params": {"ctx_request_id": "cmpl-ctx1"}}]}
    for chat in (False, True):
        if chat:
            ctx["choices"][0]["message"] = {"role": "assistant", "content": ODD_TEXT}
        raw = b"".join(opening_events(ctx, chat))
        events = [json.loads(line) for line in data_lines(raw)]
        assert all(e["model"] == model for e in events)
        texts = [e["choices"][0]["delta"].get("content") if chat else e["choices"][0]["text"] for e in events]
        assert "".join(t or "" for t in texts) == ODD_TEXT
    final = {"id": "cmpl-2", "model": model, "created": 1, "usage": {"completion_tokens": 1},
             "choices": [{"text": ODD_TEXT, "finish_reason": "stop", "index": 0}]}

    lines = data_lines(b"".join(closing_events(final, False, "cmpl-2", include_usage=True)))
    assert lines[-1] == "[DONE]"
    assert json.loads(lines[0])["choices"][0]["text"] == ODD_TEXT
    assert data_lines(sse_event(json.dumps({"m": ODD_TEXT}, ensure_ascii=False))) == [
        escape_line_breaks(json.dumps({"m": ODD_TEXT}, ensure_ascii=False))]


def test_raw_line_breaks_would_cut_an_event():
    """The failure this guards against: one raw U+2028 makes two lines out of one event."""
    raw = f"data: {json.dumps({'text': ODD_TEXT}, ensure_ascii=False)}\n\n".encode()
    assert len(data_lines(raw)) == 4
