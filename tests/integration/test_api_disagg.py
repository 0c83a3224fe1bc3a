"""The OpenAI API's fields through a disaggregated deployment (router, context server, generation
server) equal what one aggregated server answers, JSON and streamed: logprobs and top logprobs,
echo with prompt logprobs (lm-evaluation-harness's request shape), n seeded choices, several
prompts, chat logprobs, penalties and logit_bias, structured output (the real `openai` client's
`parse` with a pydantic model) and forced tool calls. Both deployments run builtin:tiny-llama in
float32."""

from __future__ import annotations

import json
from typing import Literal

import deploy_harness as dh
import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from server.openai.wire import loads

OVERRIDES = {"dtype": "float32", "max_n": 4}
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    with dh.launched("aggregated.yaml", tmp_path_factory.mktemp("agg"), OVERRIDES) as agg, \
            dh.launched("disagg.yaml", tmp_path_factory.mktemp("disagg"), OVERRIDES) as disagg:
        yield agg.url, disagg.url


def _post(url: str, path: str, body: dict) -> dict:
    response = httpx.post(url + path, json=body, timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    return response.json()


def _stream(url: str, path: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", url + path, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                      timeout=TIMEOUT_S) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(loads(line[6:]))
    return events


def _answer(body: dict) -> dict:
    """What must agree between the modes: the choices and the usage (not ids, times or cache hits,
    which depend on what each deployment's caches hold)."""
    return {"choices": sorted(body["choices"], key=lambda c: c["index"]), "usage": _counts(body["usage"])}


def _counts(usage: dict | None) -> dict | None:
    return None if usage is None else {k: v for k, v in usage.items() if k != "prompt_tokens_details"}


def _assembled(events: list[dict], chat: bool) -> dict:
    """A stream as per-choice text, logprobs and finish reasons, and its usage."""
    choices: dict[int, dict] = {}
    usage = None
    for event in events:
        assert "error" not in event, event
        usage = _counts(event.get("usage")) or usage
        for c in event["choices"]:
            got = choices.setdefault(c["index"], {"text": "", "logprobs": [], "finish_reason": None})
            got["text"] += (c["delta"].get("content") or "") if chat else c["text"]
            if c.get("logprobs"):
                got["logprobs"].append(c["logprobs"]["content"] if chat else c["logprobs"])
            got["finish_reason"] = c["finish_reason"] or got["finish_reason"]
    return {"choices": choices, "usage": usage}


def _flat_completion_logprobs(parts: list[dict]) -> dict:
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: [v for p in parts for v in p[k]] for k in keys}


def _close(a, b, tol: float = 1e-4) -> bool:
    """Equal structures, floats within `tol` (the two servers batch differently)."""
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and abs(a - b) <= tol
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_close(a[k], b[k], tol) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b, strict=True))
    return a == b


COMPLETIONS = {
    "logprobs": {"prompt": "The river ran past the old", "max_tokens": 6, "temperature": 0, "logprobs": 3,
                 "ignore_eos": True},
    "lm_eval_loglikelihood": {"prompt": [[15, 72, 301, 44, 9, 120, 77]], "max_tokens": 1, "temperature": 0,
                              "logprobs": 1, "echo": True, "seed": 1234},
    # nothing generated: the router has no first token to hand over, one server serves it
    "echo_prompt_only": {"prompt": "Once upon a time, in a land", "max_tokens": 0, "logprobs": 2, "echo": True},
    "echo_and_more": {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0, "logprobs": 2, "echo": True,
                      "ignore_eos": True},
    "seeded_choices": {"prompt": "A list of things:", "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 3,
                       "ignore_eos": True},
    "several_prompts": {"prompt": ["First prompt here", "A second, longer prompt goes here"], "max_tokens": 5,
                        "temperature": 0.8, "seed": 3, "n": 2, "ignore_eos": True, "logprobs": 1},
    "penalties": {"prompt": "the the the the the", "max_tokens": 10, "temperature": 0, "ignore_eos": True,
                  "frequency_penalty": 1.2, "presence_penalty": 0.5, "repetition_penalty": 1.3,
                  "logit_bias": {"101": 5.0, "102": -100}},
}
CHAT = {
    "logprobs": {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 6, "temperature": 0,
                 "logprobs": True, "top_logprobs": 3, "ignore_eos": True},
    "seeded_choices": {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6,
                       "temperature": 1.0, "seed": 11, "n": 2, "ignore_eos": True, "min_p": 0.05},
}


def _both(urls: tuple[str, str], path: str, body: dict, chat: bool) -> tuple[dict, list[dict]]:
    """The aggregated server's JSON answer, checked equal to the pair's, and both deployments'
    streams assembled (aggregated first)."""
    want, got = _answer(_post(urls[0], path, body)), _answer(_post(urls[1], path, body))
    assert _close(got, want), (got, want)
    return want, [_assembled(_stream(u, path, body), chat=chat) for u in urls]


@pytest.mark.parametrize("case", sorted(COMPLETIONS))
def test_completions_equal_aggregated(urls, case):
    want, streamed = _both(urls, "/v1/completions", COMPLETIONS[case], chat=False)
    for s in streamed:
        for c in s["choices"].values():
            c["logprobs"] = _flat_completion_logprobs(c["logprobs"]) if c["logprobs"] else None
    assert _close(streamed[1], streamed[0]), streamed
    texts = {c["index"]: c["text"] for c in want["choices"]}
    assert {i: c["text"] for i, c in streamed[0]["choices"].items()} == texts  # a stream says what JSON says
    assert streamed[0]["usage"] == want["usage"]


def test_echo_without_generation_is_served_by_one_server(urls):
    """No token to generate, so no first token for a context leg to hand over: the router sends the
    request to one generation server, which answers it as one aggregated server does (the case above)."""
    count = lambda: dh.metric(urls[1], "pdserve_router_local_requests_total", 'reason="prompt_only"')
    before = count()
    _post(urls[1], "/v1/completions", COMPLETIONS["echo_prompt_only"])
    assert count() == before + 1


@pytest.mark.parametrize("case", sorted(CHAT))
def test_chat_equals_aggregated(urls, case):
    want, streamed = _both(urls, "/v1/chat/completions", CHAT[case], chat=True)
    for s in streamed:
        for c in s["choices"].values():
            c["logprobs"] = [e for part in c["logprobs"] for e in part] or None
    assert _close(streamed[1], streamed[0]), streamed
    assert streamed[0]["usage"] == want["usage"]


def test_lm_eval_shape_scores_the_prompt(urls):
    """echo + logprobs + max_tokens 1: one logprob per prompt token (the first null) and one more."""
    agg, _ = urls
    body = COMPLETIONS["lm_eval_loglikelihood"]
    [choice] = _post(agg, "/v1/completions", body)["choices"]
    logprobs = choice["logprobs"]
    assert logprobs["token_logprobs"][0] is None and len(logprobs["token_logprobs"]) == len(body["prompt"][0]) + 1
    assert all(isinstance(v, float) and v <= 0 for v in logprobs["token_logprobs"][1:])
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])


class Weather(BaseModel):
    """A strict schema a random-weight model can only finish by the grammar: enums, booleans, short strings."""

    city: Literal["Paris", "Oslo", "Lima"]
    sunny: bool
    note: str = Field(max_length=6)


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}]


def _client(url: str) -> openai.OpenAI:
    return dh.openai_client(url, TIMEOUT_S)


def test_parse_with_a_pydantic_model_in_both_modes(urls):
    """`client.chat.completions.parse` (OpenAI's strict json_schema from a pydantic model) gives a
    parsed object, the same one aggregated and disaggregated."""
    parsed = []
    for url in urls:
        completion = _client(url).chat.completions.parse(
            model="builtin:tiny-llama", messages=[{"role": "user", "content": "Weather?"}], response_format=Weather,
            max_completion_tokens=80, temperature=0)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop" and isinstance(choice.message.parsed, Weather), choice
        parsed.append(choice.message.parsed)
    assert parsed[0] == parsed[1]


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_in_both_modes_and_streamed(urls, tool_choice):
    """One call (`parallel_tool_calls: false`: a random-weight model would go on adding calls to an
    open array until max_tokens), named and parsed, JSON and streamed, the same in both modes."""
    calls = []
    for url in urls:
        client = _client(url)
        out = client.chat.completions.create(model="builtin:tiny-llama", messages=[{"role": "user", "content": "?"}],
                                             tools=TOOLS, tool_choice=tool_choice, max_tokens=60, temperature=0,
                                             parallel_tool_calls=False)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
        call = choice.message.tool_calls[0]
        assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
        calls.append((call.function.name, call.function.arguments))
        stream = client.chat.completions.create(model="builtin:tiny-llama", messages=[{"role": "user", "content": "?"}],
                                                tools=TOOLS, tool_choice=tool_choice, max_tokens=60, temperature=0,
                                                parallel_tool_calls=False, stream=True)
        name, arguments, finish = None, "", None
        for chunk in stream:
            for c in chunk.choices:
                for delta in c.delta.tool_calls or []:
                    name = delta.function.name or name
                    arguments += delta.function.arguments or ""
                finish = c.finish_reason or finish
        assert (name, arguments, finish) == (call.function.name, call.function.arguments, "tool_calls")
    assert calls[0] == calls[1]


def test_json_schema_and_regex_equal_aggregated(urls):
    agg, disagg = urls
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}, "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    bodies = [
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 40, "temperature": 0.7, "seed": 2,
         "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}},
        {"messages": [{"role": "user", "content": "y"}], "max_tokens": 20, "temperature": 0,
         "structured_outputs": {"regex": "(yes|no)-[0-9]{3}"}},
    ]
    for body in bodies:
        want, got = (_answer(_post(u, "/v1/chat/completions", body)) for u in (agg, disagg))
        assert _close(got, want), (got, want)
        assert want["choices"][0]["finish_reason"] == "stop"


def test_streamed_chat_logprobs_through_the_openai_client(urls):
    """The real client's streamed chat with logprobs: every content token of every chunk comes with
    its logprob and top_logprobs, and the tokens join into the text, the same in both modes."""
    got = []
    for url in urls:
        stream = _client(url).chat.completions.create(
            model="builtin:tiny-llama", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0,
            logprobs=True, top_logprobs=2, stream=True, extra_body={"ignore_eos": True})
        text, entries = "", []
        for chunk in stream:
            for c in chunk.choices:
                text += c.delta.content or ""
                entries += c.logprobs.content if c.logprobs and c.logprobs.content else []
        assert len(entries) == 8 and all(len(e.top_logprobs) == 2 for e in entries)
        assert "".join(e.token for e in entries) == text
        got.append(entries)
    assert [e.token for e in got[0]] == [e.token for e in got[1]]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(*got, strict=True))
