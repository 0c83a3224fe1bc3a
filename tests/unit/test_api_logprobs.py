"""Log-probabilities and echo through the HTTP layer, in JSON and SSE, checked exactly and parsed
back with the `openai` package's models.

The fake engine's logprobs are fixed functions (`FakeEngine.logprob`, `prompt_logprob`) and its
tokenizer is byte-level (one token per ASCII character), so every entry is known.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion_choice import Logprobs
from test_api_engine_fake import FakeEngine, sse_chunks

from server.api.app import create_app
from server.models.tiny_tokenizer import train_tokenizer
from server.openai.logprobs import Piece, TextOffsets, TokenPieces


@pytest.fixture(scope="module")
def engine() -> FakeEngine:
    return FakeEngine(max_seq_len=256)


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(lambda: engine)) as c:
        yield c


def token(engine: FakeEngine, token_id: int) -> str:
    return engine.tokenizer.decode([token_id])


def top(engine: FakeEngine, entry) -> dict[str, float] | None:
    """Completions' top_logprobs of an entry: its alternatives, and the token itself always."""
    if entry is None:
        return None
    return {token(engine, t): lp for t, lp in entry.top} | {token(engine, entry.token_id): entry.logprob}


def generated(engine: FakeEngine, prompt: str, count: int, k: int, choice: int = 0) -> dict:
    """The completions logprobs of the fake's first `count` generated tokens (offsets from 0)."""
    text = engine.expected_text(engine.tokenizer.encode(prompt), count, choice)
    entries = [engine.logprob(engine.tokenizer.encode(ch)[0], i, choice, k) for i, ch in enumerate(text)]
    return {"tokens": list(text), "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [top(engine, e) for e in entries], "text_offset": list(range(count))}


def test_completion_logprobs_json_and_stream(client, engine):
    request = {"prompt": "hello", "max_tokens": 4, "logprobs": 2}
    body = client.post("/v1/completions", json=request).json()
    Completion.model_validate(body)
    assert body["choices"][0]["logprobs"] == generated(engine, "hello", 4, 2)
    chunks = sse_chunks(client.post("/v1/completions", json={**request, "stream": True}))
    for chunk in chunks:  # the SDK types a streamed choice's finish_reason non-null: only the last has one
        Logprobs.model_validate(chunk["choices"][0]["logprobs"])
    Completion.model_validate(chunks[-1])
    streamed = {key: [v for c in chunks for v in c["choices"][0]["logprobs"][key]] for key in generated(
        engine, "hello", 4, 2)}
    assert streamed == body["choices"][0]["logprobs"]
    assert [len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks] == [1, 1, 1, 1]  # each chunk its tokens


def test_logprobs_zero_still_gives_the_sampled_tokens(client, engine):
    body = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "logprobs": 0}).json()
    assert body["choices"][0]["logprobs"] == generated(engine, "hello", 2, 0)
    assert all(len(top) == 1 for top in body["choices"][0]["logprobs"]["top_logprobs"])


def echoed(engine: FakeEngine, prompt: str, k: int) -> dict:
    ids = engine.tokenizer.encode(prompt)
    entries = [engine.prompt_logprob(t, j, k) for j, t in enumerate(ids)]
    return {"tokens": list(prompt), "token_logprobs": [e and e.logprob for e in entries],
            "top_logprobs": [top(engine, e) for e in entries], "text_offset": list(range(len(prompt)))}


def test_echo_puts_the_prompt_and_its_logprobs_first(client, engine):
    body = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "echo": True, "logprobs": 1}).json()
    gen = generated(engine, "abc", 2, 1)
    prompt = echoed(engine, "abc", 1)
    assert body["choices"][0]["text"] == "abc" + "".join(gen["tokens"])
    assert body["choices"][0]["logprobs"] == {
        "tokens": prompt["tokens"] + gen["tokens"], "token_logprobs": prompt["token_logprobs"] + gen["token_logprobs"],
        "top_logprobs": prompt["top_logprobs"] + gen["top_logprobs"], "text_offset": [0, 1, 2, 3, 4]}
    assert body["choices"][0]["logprobs"]["token_logprobs"][0] is None  # nothing predicts the first token
    chunks = sse_chunks(client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "echo": True,
                                                         "logprobs": 1, "stream": True}))
    assert [c["choices"][0]["text"] for c in chunks] == ["abc" + gen["tokens"][0], gen["tokens"][1]]
    assert [c["choices"][0]["logprobs"]["text_offset"] for c in chunks] == [[0, 1, 2, 3], [4]]


def test_echo_without_logprobs_and_of_token_prompts(client, engine):
    ids = engine.tokenizer.encode("hi")
    body = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "echo": True}).json()
    assert body["choices"][0]["text"] == "hi" + engine.expected_text(ids, 1)
    assert body["choices"][0]["logprobs"] is None


def test_echo_with_max_tokens_zero_answers_only_the_prompt(client, engine):
    for stream in (False, True):
        response = client.post("/v1/completions", json={"prompt": "abcd", "max_tokens": 0, "echo": True,
                                                        "logprobs": 0, "stream": stream,
                                                        "stream_options": {"include_usage": True}})
        body = sse_chunks(response)[0] if stream else response.json()
        usage = sse_chunks(response)[-1]["usage"] if stream else body["usage"]
        assert body["choices"][0]["text"] == "abcd"
        assert body["choices"][0]["logprobs"] == echoed(engine, "abcd", 0)
        assert body["choices"][0]["finish_reason"] == "length"
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (4, 0)
    assert engine.requests[-1].sampling.max_tokens == 1  # the engine generates one, the answer drops it


def test_lm_evaluation_harness_loglikelihood_request(client, engine):
    """What lm-evaluation-harness sends for loglikelihood: several prompts, echo, logprobs 1, one token."""
    prompts = ["The cat", "A dog ran"]
    body = client.post("/v1/completions", json={"prompt": prompts, "echo": True, "logprobs": 1, "max_tokens": 1,
                                                "temperature": 0}).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for prompt, choice in zip(prompts, body["choices"], strict=True):
        gen = generated(engine, prompt, 1, 1)
        expected = echoed(engine, prompt, 1)
        assert choice["text"] == prompt + gen["tokens"][0]
        assert choice["logprobs"] == {key: expected[key] + gen[key] if key != "text_offset"
                                      else expected[key] + [len(prompt)] for key in expected}
        ctxlen = len(prompt)  # lm-eval reads the prompt's tokens' logprobs from the first ctxlen entries
        assert choice["logprobs"]["token_logprobs"][1:ctxlen] == expected["token_logprobs"][1:]
    assert body["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)


def test_tokens_without_text_send_their_logprobs_with_the_next_chunk(client, engine):
    chunks = sse_chunks(client.post("/v1/completions", json={"prompt": "UTF8", "max_tokens": 2, "logprobs": 0,
                                                         "stream": True}))
    assert len(chunks) == 1 and chunks[0]["choices"][0]["text"] == "é"
    logprobs = chunks[0]["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["\ufffd", "\ufffd"]  # each half of "é" decoded alone
    assert logprobs["text_offset"] == [0, 0]  # both start the one character


def test_chat_logprobs_json_and_stream(client, engine):
    messages = [{"role": "user", "content": "hi"}]
    request = {"messages": messages, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}
    body = client.post("/v1/chat/completions", json=request).json()
    ChatCompletion.model_validate(body)
    text = body["choices"][0]["message"]["content"]
    expected = []
    for i, ch in enumerate(text):
        entry = engine.logprob(engine.tokenizer.encode(ch)[0], i, 0, 2)
        expected.append({"token": ch, "logprob": entry.logprob, "bytes": list(ch.encode()), "top_logprobs": [
            {"token": token(engine, t), "logprob": lp, "bytes": list(token(engine, t).encode())}
            for t, lp in entry.top]})
    assert body["choices"][0]["logprobs"] == {"content": expected}
    chunks = sse_chunks(client.post("/v1/chat/completions", json={**request, "stream": True}))
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk)
    assert chunks[0]["choices"][0]["logprobs"] is None  # the role chunk
    assert [e for c in chunks[1:] for e in c["choices"][0]["logprobs"]["content"]] == expected


def test_chat_logprobs_without_top_logprobs(client, engine):
    body = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 1, "logprobs": True}).json()
    assert [e["top_logprobs"] for e in body["choices"][0]["logprobs"]["content"]] == [[]]
    body = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 1}).json()
    assert body["choices"][0]["logprobs"] is None


def test_token_pieces_of_a_byte_level_bpe_tokenizer():
    tokenizer = train_tokenizer()
    pieces = TokenPieces(tokenizer)
    ids = tokenizer.encode("é the")
    assert [pieces.piece(t).data for t in ids] == [b"\xc3", b"\xa9", b" the"]
    assert [pieces.piece(t).text for t in ids] == ["\ufffd", "\ufffd", " the"]
    assert pieces.piece(tokenizer.eos_token_id) == Piece("<|eos|>", b"<|eos|>", special=True)
    assert pieces.piece(10_000) == Piece("", b"", special=True)  # beyond the tokenizer (a padded vocabulary)
    offsets = TextOffsets()
    assert [offsets.advance(pieces.piece(t)) for t in [tokenizer.bos_token_id, *ids]] == [0, 0, 0, 1]
    assert offsets.chars == 5
