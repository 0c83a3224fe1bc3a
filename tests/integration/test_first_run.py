"""The README's first run: `pdserve launch configs/disagg.yaml` on its default model, then the README's
own requests (read from README.md), answered by the router with readable text."""

from __future__ import annotations

import json
import re

import deploy_harness as dh
import httpx
import openai
import pytest
import yaml

from pdserve_bench import tiny_story_corpus as corpus

DEFAULT_MODEL = "builtin:tiny-story"


def readme_requests() -> list[tuple[str, dict]]:
    """(path, JSON body) of every `curl -s localhost:8000/...  -d '{...}'` line in README.md."""
    found = re.findall(r"curl -s localhost:8000(/v1/\S+) -d '(\{.*?\})'", (dh.ROOT / "README.md").read_text())
    return [(path, json.loads(body)) for path, body in found]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    assert yaml.safe_load((dh.ROOT / "configs" / "disagg.yaml").read_text())["model"] == DEFAULT_MODEL
    with dh.launched("disagg.yaml", tmp_path_factory.mktemp("first"), {"model": DEFAULT_MODEL}) as dep:
        yield dep


def assert_readable(text: str, words: set[str]) -> None:
    assert "\ufffd" not in text and text.strip(), text
    generated = corpus.split_words(text)
    assert len(generated) >= 3 and sum(w in words for w in generated) / len(generated) >= 0.8, text


def readme_quote(before: str) -> str:
    """The README's quoted answer after `before`, whitespace normalised (the quote is line-wrapped)."""
    found = re.search(rf'{before} `"(.*?)"`', (dh.ROOT / "README.md").read_text(), re.S)
    assert found, f"README.md quotes no answer after {before!r}"
    return " ".join(found.group(1).split())


def test_readme_requests_answer_with_readable_text(deployment):
    requests = readme_requests()
    assert {path for path, _ in requests} == {"/v1/completions", "/v1/chat/completions"}
    words = corpus.corpus_words()
    answers = {}
    for path, body in requests:
        response = httpx.post(f"{deployment.url}{path}", json=body, timeout=60)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        answers[path] = choice["text"] if "text" in choice else choice["message"]["content"]
        assert_readable(answers[path], words)
    # what the README says they answer (greedy, so exactly)
    assert " ".join(answers["/v1/completions"].split()) == readme_quote("continues with")
    chat_start = readme_quote("chat answer begins").removesuffix(" ...")
    assert " ".join(answers["/v1/chat/completions"].split()).startswith(chat_start)


def test_openai_chat_client_gets_an_answer(deployment):
    client = openai.OpenAI(base_url=f"{deployment.url}/v1", api_key="unused", max_retries=0, timeout=60)
    chat = client.chat.completions.create(model=DEFAULT_MODEL, max_tokens=64, temperature=0, messages=[
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "How do I sort a list?"}])
    assert chat.choices[0].message.role == "assistant"
    assert_readable(chat.choices[0].message.content, corpus.corpus_words())
    stream = client.chat.completions.create(model=DEFAULT_MODEL, max_tokens=32, temperature=0, stream=True,
                                            messages=[{"role": "user", "content": "What is a tuple?"}])
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert_readable(streamed, corpus.corpus_words())
