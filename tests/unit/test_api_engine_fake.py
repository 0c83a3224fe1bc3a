"""A small deterministic engine implementing `server.types.EngineClient`, for the HTTP API tests.

It uses a real byte-level tokenizer (built here with `tokenizers`, no download) with a chat template.
Generated text is a fixed function of the prompt ids, one printable character per token, so streamed
and non-streamed text can be compared exactly. Words in the prompt trigger engine behaviours:
FAIL503 (error before any token), FAILMID (two tokens, then a 502), RAISE (the iterator raises),
ABORTED (the engine aborts the request), UTF8 (a character split over two tokens), HANG (one token,
then silence) and HANGFIRST (silence before any token). Silences end after `HANG_S` (every wait has
a timeout); tests that use them disconnect first.

The tests at the bottom pin the fake to the `EngineClient` contract the API relies on.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from server.types import DisaggParams, GenerateRequest, LinkState, RequestOutput

ALPHABET = "abcdefghijklmnopqrstuvwxyz "
HANG_S = 30.0
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@functools.lru_cache(maxsize=1)
def make_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: ids 0..255 are bytes, 256 `<s>`, 257 `</s>`; no merges."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


class FakeEngine:
    """Deterministic `EngineClient`; records every request, abort and closed output iterator."""

    def __init__(self, model_name: str = "fake-model", max_seq_len: int = 128, ready: bool = True,
                 vocab_size: int | None = None):
        self.model_name = model_name
        self._vocab_size = vocab_size  # the model's; None: as many as the tokenizer has
        self.max_seq_len = max_seq_len
        self.ready = ready
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.released: list[str] = []  # ctx_request_ids of leases released through /kv_cache/release
        self.closed: list[str] = []  # request ids whose output iterator ended (any way)
        self._seen_prompts: set[tuple[int, ...]] = set()
        self._cached: dict[str, int] = {}  # request id -> its prefix-cache hit, fixed at arrival

    @property
    def tokenizer(self) -> PreTrainedTokenizerFast:
        return make_tokenizer()

    @property
    def vocab_size(self) -> int:
        return self._vocab_size or len(make_tokenizer())

    def is_ready(self) -> bool:
        return self.ready

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def release_lease(self, ctx_request_id: str) -> None:
        self.released.append(ctx_request_id)

    def links(self) -> LinkState:  # no KV transceiver
        return LinkState()

    def idle(self) -> bool:
        return True

    def expected_text(self, prompt_ids: list[int], max_tokens: int) -> str:
        start = sum(prompt_ids)
        return "".join(ALPHABET[(start + 5 * i) % len(ALPHABET)] for i in range(max_tokens))

    def cached_tokens(self, prompt_ids: list[int]) -> int:
        """A repeated prompt hits the "prefix cache" in whole blocks of 4, leaving the last token."""
        return (len(prompt_ids) - 1) // 4 * 4 if tuple(prompt_ids) in self._seen_prompts else 0

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        self.requests.append(request)
        self._cached[request.request_id] = self.cached_tokens(request.prompt_token_ids)
        self._seen_prompts.add(tuple(request.prompt_token_ids))
        try:
            async for output in self._outputs(request):
                yield output
                await asyncio.sleep(0)
        finally:
            self.closed.append(request.request_id)

    def _output(self, req: GenerateRequest, ids: list[int], text: str, done: int, **final) -> RequestOutput:
        prompt = req.prompt_token_ids
        return RequestOutput(req.request_id, ids, text, finished=bool(final), prompt_tokens=len(prompt),
                             completion_tokens=done, cached_tokens=self._cached[req.request_id], **final)

    async def _outputs(self, req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        prompt_text = self.tokenizer.decode(req.prompt_token_ids)
        if "HANGFIRST" in prompt_text:
            await asyncio.sleep(HANG_S)
        if "FAIL503" in prompt_text:
            yield self._output(req, [], "", 0, finish_reason="error", error="no KV from the context server",
                               error_code=503)
            return
        if "UTF8" in prompt_text:
            first, second = self.tokenizer.encode("é")
            yield self._output(req, [first], "", 1)
            yield self._output(req, [second], "é", 2, finish_reason="length")
            return
        async for output in self._text_outputs(req, prompt_text):
            yield output

    async def _text_outputs(self, req: GenerateRequest, prompt_text: str) -> AsyncIterator[RequestOutput]:
        max_tokens = 1 if _is_context_only(req) else req.sampling.max_tokens
        text = self.expected_text(req.prompt_token_ids, max_tokens)
        for i, ch in enumerate(text):
            if i == 2 and "FAILMID" in prompt_text:
                yield self._output(req, [], "", i, finish_reason="error", error="generation leg lost",
                                   error_code=502)
                return
            if i == 1 and "RAISE" in prompt_text:
                raise RuntimeError("model runner crashed")
            if i == 1 and "HANG" in prompt_text:
                await asyncio.sleep(HANG_S)
            last = i == max_tokens - 1
            final = self._final_fields(req, prompt_text, ch) if last else {}
            yield self._output(req, self.tokenizer.encode(ch), ch, i + 1, **final)

    def _final_fields(self, req: GenerateRequest, prompt_text: str, ch: str) -> dict:
        if "ABORTED" in prompt_text:
            return {"finish_reason": "abort", "error": "server shutting down"}
        if not _is_context_only(req):
            return {"finish_reason": "length"}
        disagg = DisaggParams("context_only", ctx_request_id=f"ctx-{req.request_id}",
                              ctx_endpoint="tcp://127.0.0.1:5555", ctx_epoch="epoch-1",
                              first_gen_tokens=tuple(self.tokenizer.encode(ch)),
                              prompt_token_ids=tuple(req.prompt_token_ids))
        return {"finish_reason": "length", "disagg": disagg}


def _is_context_only(req: GenerateRequest) -> bool:
    return req.disagg is not None and req.disagg.request_type == "context_only"


# -- the fake honours the contract the API relies on -----------------------------------------------


def _run(engine: FakeEngine, prompt: str, max_tokens: int) -> list[RequestOutput]:
    from server.types import SamplingParams

    async def collect() -> list[RequestOutput]:
        req = GenerateRequest("r1", engine.tokenizer.encode(prompt), SamplingParams(max_tokens=max_tokens))
        return [out async for out in engine.generate(req)]

    return asyncio.run(collect())


def test_fake_engine_outputs_are_incremental_and_end_with_one_final():
    engine = FakeEngine()
    outputs = _run(engine, "hello", 5)
    prompt_ids = engine.tokenizer.encode("hello")
    assert "".join(o.new_text for o in outputs) == engine.expected_text(prompt_ids, 5)
    assert [o.finished for o in outputs] == [False] * 4 + [True]
    assert [o.completion_tokens for o in outputs] == [1, 2, 3, 4, 5]
    assert outputs[-1].finish_reason == "length"
    assert engine.closed == ["r1"]


def test_fake_tokenizer_round_trips_bytes_and_renders_chat():
    tok = make_tokenizer()
    assert len(tok) == 258
    assert tok.decode(tok.encode("héllo wörld")) == "héllo wörld"
    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|user|>hi\n<|assistant|>"


# -- helpers for the API test files ------------------------------------------------------------------


def sse_events(body: str) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing (`data: ...` + blank line) exactly."""
    assert body.endswith("\n\n"), body[-40:]
    blocks = body[:-2].split("\n\n")
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks), blocks
    return [b.removeprefix("data: ") for b in blocks]


TOKEN = "unit-test-deployment-token-0123456789"
KNOWN_ENDPOINTS = frozenset({"tcp://h:1", "tcp://127.0.0.1:1"})


class KnownEndpoints:
    """A `ContextDirectory` stand-in for HTTP-layer tests: the deployment's KV endpoints, fixed."""

    def __init__(self, endpoints: frozenset[str] = KNOWN_ENDPOINTS) -> None:
        self.endpoints = endpoints
        self.asked: list[str] = []

    async def knows(self, endpoint: str) -> bool:
        self.asked.append(endpoint)
        return endpoint in self.endpoints

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass


def deployment_app(engine_factory, directory: KnownEndpoints | None = None):
    """An app configured as a server of a deployment: it holds `TOKEN` and knows its context servers."""
    from server.api import create_app

    return create_app(engine_factory, auth_token=TOKEN, context_directory=directory or KnownEndpoints())
