"""Every request field is implemented, accepted as harmless, or refused by name; never ignored.

Refused fields and values out of range get a 400 whose `param` is the field; fields of no API are
ignored with one log line per name. The implemented ones reach the engine's `SamplingParams`.
"""

from __future__ import annotations

import logging

import pytest
from fastapi.testclient import TestClient
from test_api_engine_fake import FakeEngine

from server.api.app import create_app
from server.types import SamplingParams, StructuredSpec

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(lambda: engine, max_n=4)) as c:
        yield c


def refused(param: str, accepted: str) -> dict:
    """`accepted`: the end of the message, from what is accepted on (`null)`, `null); use tools`)."""
    return {"error": {"message": f"'{param}': not supported by pdserve (accepted: {accepted}",
                      "type": "invalid_request_error", "param": param, "code": None}}


def bad(param: str, message: str) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": None}}


# (route, field, value, what the error says is accepted)
REFUSED = [
    ("completions", "suffix", " and so on", 'null, "")'),
    ("completions", "add_special_tokens", False, "null, true)"),
    ("completions", "use_beam_search", True, "null, false)"),
    ("completions", "length_penalty", 0.5, "null, 1.0)"),
    ("completions", "bad_words", ["no"], "null, [])"),
    ("completions", "allowed_token_ids", [1, 2], "null)"),
    ("completions", "prompt_logprobs", 1, "null); completions: use echo with logprobs"),
    ("completions", "include_stop_str_in_output", True, "null, false)"),
    ("completions", "skip_special_tokens", False, "null, true)"),
    ("completions", "spaces_between_special_tokens", False, "null, true)"),
    ("completions", "truncate_prompt_tokens", 8, "null)"),
    ("completions", "logits_processors", ["m.f"], "null)"),
    ("completions", "return_tokens_as_token_ids", True, "null, false)"),
    ("completions", "guided_whitespace_pattern", " ", "null)"),
    ("completions", "priority", 3, "null, 0)"),
    ("chat/completions", "store", True, "null, false); pdserve stores no completions"),
    ("chat/completions", "service_tier", "flex", 'null, "auto", "default")'),
    ("chat/completions", "prompt_cache_retention", "24h", 'null, "in_memory")'),
    ("chat/completions", "prompt_cache_options", {"mode": "explicit"}, 'null, {"mode": "implicit"})'),
    ("chat/completions", "verbosity", "low", 'null, "medium")'),
    ("chat/completions", "audio", {"voice": "alloy", "format": "wav"}, "null)"),
    ("chat/completions", "modalities", ["text", "audio"], 'null, ["text"])'),
    ("chat/completions", "prediction", {"type": "content", "content": "x"}, "null)"),
    ("chat/completions", "web_search_options", {}, "null)"),
    ("chat/completions", "reasoning_effort", "low", "null)"),
    ("chat/completions", "moderation", {"model": "omni-moderation-latest"}, "null)"),
    ("chat/completions", "functions", [{"name": "f"}], "null); use tools"),
    ("chat/completions", "function_call", "auto", "null); use tool_choice"),
    ("chat/completions", "echo", True, "null, false)"),
    ("chat/completions", "add_generation_prompt", False, "null, true)"),
    ("chat/completions", "continue_final_message", True, "null, false)"),
    ("chat/completions", "add_special_tokens", True, "null, false)"),
    ("chat/completions", "chat_template", "{{ messages }}", "null)"),
    ("chat/completions", "chat_template_kwargs", {"enable_thinking": False}, "null)"),
    ("chat/completions", "documents", [{"text": "d"}], "null)"),
    ("chat/completions", "mm_processor_kwargs", {}, "null)"),
]


@pytest.mark.parametrize(("route", "field", "value", "accepted"), REFUSED)
def test_unimplemented_fields_are_refused_by_name(client, engine, route, field, value, accepted):
    before = len(engine.requests)
    body = {**(CHAT if route.startswith("chat") else COMPLETION), field: value}
    response = client.post(f"/v1/{route}", json=body)
    assert response.status_code == 400, response.text
    assert response.json() == refused(field, accepted)
    assert len(engine.requests) == before  # nothing reached the engine


NESTED_REFUSED = [
    ({"messages": [{"role": "assistant", "content": "x", "function_call": {"name": "f", "arguments": "{}"}}]},
     "messages.0.function_call", "null); send tool_calls"),
    ({"messages": [{"role": "assistant", "content": None, "audio": {"id": "a1"}}]}, "messages.0.audio", "null)"),
    ({"messages": [{"role": "assistant", "content": "x", "refusal": "no"}]}, "messages.0.refusal", "null)"),
    ({"messages": [{"role": "user", "content": "x"}], "structured_outputs": {"regex": "a+", "structural_tag": "t"}},
     "structured_outputs.structural_tag", "null)"),
]


@pytest.mark.parametrize(("body", "param", "accepted"), NESTED_REFUSED)
def test_unimplemented_nested_fields_are_refused_by_name(client, body, param, accepted):
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json() == refused(param, accepted)


HARMLESS = [
    ("chat/completions", {"user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
                          "safety_identifier": "s", "prompt_cache_key": "p", "prompt_cache_retention": "in_memory",
                          "prompt_cache_options": {"mode": "implicit"}, "verbosity": "medium",
                          "modalities": ["text"], "stream_options": {"include_obfuscation": True},
                          "guided_decoding_backend": "xgrammar", "parallel_tool_calls": True, "tools": [],
                          "tool_choice": "none", "echo": False, "add_generation_prompt": True,
                          "response_format": {"type": "text"}, "logprobs": False, "n": 1}),
    ("chat/completions", {"service_tier": "default", "functions": None, "function_call": None, "audio": None}),
    ("completions", {"user": "u", "suffix": "", "best_of": 1, "length_penalty": 1, "skip_special_tokens": True,
                     "use_beam_search": False, "bad_words": [], "priority": 0, "echo": False, "logit_bias": {},
                     "presence_penalty": 0, "frequency_penalty": 0.0, "min_p": 0, "repetition_penalty": 1}),
]


@pytest.mark.parametrize(("route", "extra"), HARMLESS)
def test_harmless_fields_are_accepted_and_change_nothing(client, engine, route, extra):
    base = CHAT if route.startswith("chat") else COMPLETION
    assert client.post(f"/v1/{route}", json=base).status_code == 200
    plain = engine.requests[-1]
    response = client.post(f"/v1/{route}", json={**base, **extra})
    assert response.status_code == 200, response.text
    assert (engine.requests[-1].sampling, engine.requests[-1].prompt_token_ids) == (plain.sampling,
                                                                                   plain.prompt_token_ids)


# (route, body change, param, message)
OUT_OF_RANGE = [
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs",
     "'top_logprobs': Input should be less than or equal to 20"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs", "'top_logprobs': needs logprobs: true"),
    ("completions", {"logprobs": 21}, "logprobs", "'logprobs': Input should be less than or equal to 20"),
    ("completions", {"logprobs": -1}, "logprobs", "'logprobs': Input should be greater than or equal to 0"),
    ("completions", {"n": 5}, "n", "'n': 5 choices asked; this server's maximum is 4"),
    ("chat/completions", {"n": 5}, "n", "'n': 5 choices asked; this server's maximum is 4"),
    ("completions", {"n": 2, "best_of": 3}, "best_of",
     "'best_of': must equal n (2); pdserve does not rank extra candidates"),
    ("completions", {"presence_penalty": 2.5}, "presence_penalty",
     "'presence_penalty': Input should be less than or equal to 2"),
    ("chat/completions", {"frequency_penalty": -2.01}, "frequency_penalty",
     "'frequency_penalty': Input should be greater than or equal to -2"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty",
     "'repetition_penalty': Input should be greater than 0"),
    ("completions", {"min_p": 1.5}, "min_p", "'min_p': Input should be less than or equal to 1"),
    ("completions", {"logit_bias": {"5": 101}}, "logit_bias.5", "'logit_bias.5': Input should be less than or equal "
                                                                "to 100"),
    ("chat/completions", {"logit_bias": {"x": 1}}, "logit_bias",
     "'logit_bias': keys must be token ids (decimal integers), got 'x'"),
    ("completions", {"logit_bias": {"258": 1}}, "logit_bias",
     "'logit_bias': token id 258 is outside the vocabulary [0, 258)"),
    ("completions", {"echo": False, "max_tokens": 0, "stream": True, "n": 2, "best_of": 2}, "max_tokens",
     "'max_tokens': 0 is only for echo (the prompt's logprobs), not disaggregated"),
    ("chat/completions", {"messages": [{"role": "function", "content": "x", "name": "f"}]}, "messages.0.role",
     "'messages.0.role': role 'function' (the deprecated function calling) is not supported; use role 'tool' "
     "with tool_call_id"),
    ("chat/completions", {"stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage",
     "'stream_options.include_usage': Input should be a valid boolean, unable to interpret input"),
]


@pytest.mark.parametrize(("route", "change", "param", "message"), OUT_OF_RANGE)
def test_values_out_of_range_are_400_naming_the_field(client, engine, route, change, param, message):
    before = len(engine.requests)
    body = {**(CHAT if route.startswith("chat") else COMPLETION), **change}
    response = client.post(f"/v1/{route}", json=body)
    assert response.status_code == 400, response.text
    assert response.json() == bad(param, message)
    assert len(engine.requests) == before


def test_unknown_fields_are_ignored_with_one_warning_per_name(client, engine, caplog):
    body = {**COMPLETION, "max_token": 5, "frobnicate_api_test": 1}
    with caplog.at_level(logging.WARNING, logger="server.openai.fields"):
        for _ in range(3):
            assert client.post("/v1/completions", json=body).status_code == 200
        assert client.post("/v1/chat/completions", json={**CHAT, "max_token": 5}).status_code == 200
    assert engine.requests[-2].sampling.max_tokens == 2  # the typo changed nothing
    assert [r.getMessage() for r in caplog.records] == [
        "CompletionRequest: ignoring unknown field 'frobnicate_api_test' (no API pdserve implements has it; a typo?)",
        "CompletionRequest: ignoring unknown field 'max_token' (no API pdserve implements has it; a typo?)",
        "ChatCompletionRequest: ignoring unknown field 'max_token' (no API pdserve implements has it; a typo?)",
    ]


def test_sampling_fields_reach_the_engine(client, engine):
    body = {**COMPLETION, "n": 3, "best_of": 3, "logprobs": 4, "presence_penalty": 0.5, "frequency_penalty": -1.5,
            "repetition_penalty": 1.25, "min_p": 0.05, "logit_bias": {"104": 5, "7": -100}, "seed": 3}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert engine.requests[-1].sampling == SamplingParams(
        max_tokens=2, seed=3, n=3, logprobs=4, presence_penalty=0.5, frequency_penalty=-1.5,
        repetition_penalty=1.25, min_p=0.05, logit_bias=((7, -100.0), (104, 5.0)))
    body = {**CHAT, "logprobs": True, "top_logprobs": 3, "temperature": 0}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert engine.requests[-1].sampling == SamplingParams(max_tokens=2, temperature=0.0, logprobs=3)
    assert client.post("/v1/chat/completions", json={**CHAT, "logprobs": True}).status_code == 200
    assert engine.requests[-1].sampling.logprobs == 0  # the sampled token's logprob, no alternatives


def test_echo_with_logprobs_asks_the_engine_for_the_prompts(client, engine):
    assert client.post("/v1/completions", json={**COMPLETION, "echo": True, "logprobs": 2}).status_code == 200
    assert (engine.requests[-1].sampling.logprobs, engine.requests[-1].sampling.prompt_logprobs) == (2, 2)
    assert client.post("/v1/completions", json={**COMPLETION, "echo": True}).status_code == 200
    assert (engine.requests[-1].sampling.logprobs, engine.requests[-1].sampling.prompt_logprobs) == (None, None)


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
STRUCTURED = [
    ({"response_format": {"type": "json_object"}}, StructuredSpec("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}},
     StructuredSpec("json_schema", '{"type": "object", "properties": {"city": {"type": "string"}}, '
                                   '"required": ["city"]}')),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}},
     StructuredSpec("json_schema", '{"type": "object"}')),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredSpec("json_schema", '{"type": "object", "properties": '
                                                              '{"city": {"type": "string"}}, "required": ["city"]}')),
    ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredSpec("regex", "[0-9]+")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredSpec("choice", '["yes", "no"]')),
    ({"structured_outputs": {"grammar": 'root ::= "a"'}}, StructuredSpec("grammar", 'root ::= "a"')),
    ({"structured_outputs": {"json_object": True}}, StructuredSpec("json_object")),
    ({"guided_json": '{"type":"array"}'}, StructuredSpec("json_schema", '{"type": "array"}')),
    ({"guided_regex": "a|b"}, StructuredSpec("regex", "a|b")),
    ({"guided_choice": ["é", "b"]}, StructuredSpec("choice", '["é", "b"]')),
    ({"guided_grammar": 'root ::= "x"'}, StructuredSpec("grammar", 'root ::= "x"')),
]


@pytest.mark.parametrize(("fields", "spec"), STRUCTURED)
def test_structured_output_fields_map_to_one_spec(client, engine, fields, spec):
    for route, base in (("completions", COMPLETION), ("chat/completions", CHAT)):
        response = client.post(f"/v1/{route}", json={**base, **fields})
        assert response.status_code == 200, response.text
        assert engine.requests[-1].sampling.structured == spec


STRUCTURED_BAD = [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "'guided_regex': only one structured-output constraint per request (response_format is set too)"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "'structured_outputs': set exactly one of json, regex, choice, grammar, json_object (got regex, choice)"),
    ({"response_format": {"type": "json_schema"}}, "response_format",
     "'response_format': json_schema is required with type \"json_schema\", and only with it"),
    ({"response_format": {"type": "grammar"}}, "response_format.type",
     "'response_format.type': Input should be 'text', 'json_object' or 'json_schema'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "strng"}}}},
     "response_format.json_schema.schema", "'response_format.json_schema.schema': the schema: type 'strng' is not "
     "a JSON-schema type (array, boolean, integer, null, number, object, string)"),
    ({"guided_json": {"type": "object", "properties": {"a": {"required": "a"}}}}, "guided_json",
     "'guided_json': the schema.properties.a: required must be a list of property names"),
    ({"guided_json": "{not json"}, "guided_json",
     "'guided_json': not JSON text (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
    ({"guided_choice": []}, "guided_choice", "'guided_choice': List should have at least 1 item after validation, "
                                             "not 0"),
]


@pytest.mark.parametrize(("fields", "param", "message"), STRUCTURED_BAD)
def test_bad_structured_output_is_400_naming_the_field(client, engine, fields, param, message):
    before = len(engine.requests)
    response = client.post("/v1/chat/completions", json={**CHAT, **fields})
    assert response.status_code == 400, response.text
    assert response.json() == bad(param, message)
    assert len(engine.requests) == before
