"""The OpenAI API's newer fields on one real server (`pdserve serve --config`, builtin:tiny-llama)
through the real `openai` client: refusals by name, several prompts (token for token against
transformers), echo, tools rendered by the model's template, /v1/models' max_model_len."""

from __future__ import annotations

import deploy_harness as dh
import hf_reference
import openai
import pytest
from transformers import AutoTokenizer

from server.models.builtin import resolve_model

MODEL = "builtin:tiny-llama"
MAX_SEQ_LEN = 512
GREEDY = dh.GREEDY
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(its URL, its log)."""
    tmp = tmp_path_factory.mktemp("serve")
    with dh.served(tmp, model=MODEL, max_seq_len=MAX_SEQ_LEN, max_n=4) as (url, _):
        yield url, tmp / "server.log"


@pytest.fixture(scope="module")
def client(server):
    return dh.openai_client(server[0], timeout_s=60)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model(MODEL))


REFUSALS = [
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"]}, "audio"),
    ("chat", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("chat", {"n": 5}, "n"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("completions", {"suffix": "the end"}, "suffix"),
    ("completions", {"best_of": 3}, "best_of"),
]


@pytest.mark.parametrize(("endpoint", "fields", "param"), REFUSALS)
def test_unimplemented_and_out_of_range_fields_are_refused_by_name(client, endpoint, fields, param):
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           **fields)
        else:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **fields)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param and info.value.body["type"] == "invalid_request_error"


def test_unknown_fields_are_ignored_and_logged_once(client, server):
    for _ in range(2):
        out = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"max_token": 9})
        assert out.usage.completion_tokens == 2
    log = server[1].read_text()
    assert log.count("ignoring unknown field 'max_token'") == 1, log[-2000:]


def test_several_prompts_match_transformers_one_by_one(client, tokenizer):
    model_dir = resolve_model(MODEL)
    prompts = ["The quick brown fox", "Numbers like 0 1 2 appear", "Hello, world!"]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, **GREEDY)
    assert [c.index for c in out.choices] == [0, 1, 2]
    for prompt, choice in zip(prompts, out.choices, strict=True):
        ids = tokenizer.encode(prompt)
        expected = tokenizer.decode(hf_reference.hf_greedy_ignore_eos(model_dir, ids, 8), skip_special_tokens=True)
        assert choice.text == expected
    assert out.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert out.usage.completion_tokens == 24


def test_echo_puts_the_prompt_first_in_json_and_stream(client):
    prompt = "Once upon a time"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, **GREEDY)
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, echo=True, **GREEDY)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, echo=True, stream=True,
                                            **GREEDY))
    assert chunks[0].choices[0].text.startswith(prompt)
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text


def test_tools_are_rendered_by_the_models_template(client, tokenizer):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8, **GREEDY)
    rendered = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert "<tools>" in rendered
    assert out.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    none = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                          max_tokens=8, **GREEDY)
    plain = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert none.usage.prompt_tokens == len(tokenizer.encode(plain, add_special_tokens=False))
    assert none.choices[0].message.tool_calls is None


def test_models_report_max_model_len(client):
    [card] = client.models.list().data
    assert card.id == MODEL and card.model_extra["max_model_len"] == MAX_SEQ_LEN
