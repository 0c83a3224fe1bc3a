"""A small deterministic engine implementing `server.types.EngineClient`, for the HTTP API tests.

It uses a real byte-level tokenizer (built here with `tokenizers`, no download) with a chat template.
Generated text is a fixed function of the prompt ids, one printable character per token, so streamed
and non-streamed text can be compared exactly. Words in the prompt trigger engine behaviours:
FAIL503 (error before any token), FAILMID (two tokens, then a 502), RAISE (the iterator raises),
ABORTED (the engine aborts the request), UTF8 (a character split over two tokens), HANG (one token,
then silence) and HANGFIRST (silence before any token). Silences end after `HANG_S` (every wait has
a timeout); tests that use them disconnect first.

The engine contract's newer parts are honoured too: `n` choices (outputs of the choices interleave,
choice c's text shifted by 7 c letters), log-probabilities of sampled tokens (`logprob`) and of the
prompt (`prompt_logprob`, on each choice's first output), and a generation_only request's first
token (`first_gen_tokens`, one per choice, without a logprob: the engine did not sample it; its text
left out when `first_text_streamed`). `reply`, when set, is what every request answers (one token
per byte-level token), so tests can script tool calls.

The tests at the bottom pin the fake to the `EngineClient` contract the API relies on.
"""

from __future__ import annotations

import asyncio
import functools
import json
from collections.abc import AsyncIterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from server.types import DisaggParams, GenerateRequest, LinkState, RequestOutput, TokenLogprob

ALPHABET = "abcdefghijklmnopqrstuvwxyz "
HANG_S = 30.0
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@functools.lru_cache(maxsize=4)
def make_tokenizer(chat_template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: ids 0..255 are bytes, 256 `<s>`, 257 `</s>`; no merges."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>")
    tok.chat_template = chat_template
    return tok


class FakeEngine:
    """Deterministic `EngineClient`; records every request, abort and closed output iterator."""

    def __init__(self, model_name: str = "fake-model", max_seq_len: int = 128, ready: bool = True,
                 vocab_size: int | None = None, chat_template: str = CHAT_TEMPLATE):
        self.model_name = model_name
        self._chat_template = chat_template
        self._vocab_size = vocab_size  # the model's; None: as many as the tokenizer has
        self.max_seq_len = max_seq_len
        self.ready = ready
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.released: list[str] = []  # ctx_request_ids of leases released through /kv_cache/release
        self.closed: list[str] = []  # request ids whose output iterator ended (any way)
        self._seen_prompts: set[tuple[int, ...]] = set()
        self._cached: dict[str, int] = {}  # request id -> its prefix-cache hit, fixed at arrival
        self.reply: str | None = None  # every request's answer text, when set

    @property
    def tokenizer(self) -> PreTrainedTokenizerFast:
        return make_tokenizer(self._chat_template)

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

    def expected_text(self, prompt_ids: list[int], max_tokens: int, choice: int = 0) -> str:
        start = sum(prompt_ids) + 7 * choice
        return "".join(ALPHABET[(start + 5 * i) % len(ALPHABET)] for i in range(max_tokens))

    @staticmethod
    def logprob(token_id: int, position: int, choice: int, k: int) -> TokenLogprob:
        """The logprob of the sampled token at `position` of `choice`, with its top k (the token first)."""
        own = -0.25 * (position + 1) - 0.01 * choice
        top = tuple((token_id + j, own - 0.5 * j) for j in range(k))
        return TokenLogprob(token_id, own, top)

    @staticmethod
    def prompt_logprob(token_id: int, position: int, k: int) -> TokenLogprob | None:
        """The logprob of prompt token `position` (None for the first), with its top k (others first)."""
        if position == 0:
            return None
        own = -1.0 - 0.125 * position
        return TokenLogprob(token_id, own, tuple((token_id + 1 + j, own + 0.5 - 0.25 * j) for j in range(k)))

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

    def _output(self, req: GenerateRequest, ids: list[int], text: str, done: int, choice: int = 0,
                **final) -> RequestOutput:
        prompt = req.prompt_token_ids
        sampling = req.sampling
        logprobs = None
        if sampling.logprobs is not None and ids and not self._is_first_gen(req, done):
            logprobs = [self.logprob(t, done - 1, choice, sampling.logprobs) for t in ids]
        prompt_logprobs = None
        if sampling.prompt_logprobs is not None and done <= 1:
            prompt_logprobs = [self.prompt_logprob(t, j, sampling.prompt_logprobs) for j, t in enumerate(prompt)]
        return RequestOutput(req.request_id, ids, text, finished=bool(final), prompt_tokens=len(prompt),
                             completion_tokens=done, cached_tokens=self._cached[req.request_id], index=choice,
                             logprobs=logprobs, prompt_logprobs=prompt_logprobs, **final)

    @staticmethod
    def _is_first_gen(req: GenerateRequest, done: int) -> bool:
        return done == 1 and _first_gen(req) is not None

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

    def _choice_tokens(self, req: GenerateRequest, choice: int) -> list[tuple[int, str]]:
        """(token id, its text) of a choice's whole answer."""
        max_tokens = 1 if _is_context_only(req) else req.sampling.max_tokens
        first = _first_gen(req)
        if self.reply is not None:
            tokens = [(t, self.tokenizer.decode([t])) for t in self.tokenizer.encode(self.reply)][:max_tokens]
        else:
            tokens = [(self.tokenizer.encode(ch)[0], ch)
                      for ch in self.expected_text(req.prompt_token_ids, max_tokens, choice)]
        if first is not None:  # a generation leg starts with the context server's token
            token = first[choice]
            text = "" if req.disagg.first_text_streamed else self.tokenizer.decode([token])
            tokens = [(token, text), *tokens[1:]]
        return tokens

    async def _text_outputs(self, req: GenerateRequest, prompt_text: str) -> AsyncIterator[RequestOutput]:
        n = req.sampling.n
        answers = [self._choice_tokens(req, c) for c in range(n)]
        for i in range(max(len(a) for a in answers)):
            if i == 2 and "FAILMID" in prompt_text:
                yield self._output(req, [], "", i, finish_reason="error", error="generation leg lost",
                                   error_code=502)
                return
            if i == 1 and "RAISE" in prompt_text:
                raise RuntimeError("model runner crashed")
            if i == 1 and "HANG" in prompt_text:
                await asyncio.sleep(HANG_S)
            for c, answer in enumerate(answers):
                if i >= len(answer):
                    continue
                token, text = answer[i]
                final = self._final_fields(req, prompt_text, answers) if i == len(answer) - 1 else {}
                yield self._output(req, [token], text, i + 1, c, **final)

    def _final_fields(self, req: GenerateRequest, prompt_text: str, answers: list) -> dict:
        if "ABORTED" in prompt_text:
            return {"finish_reason": "abort", "error": "server shutting down"}
        if not _is_context_only(req):
            return {"finish_reason": "length"}
        disagg = DisaggParams("context_only", ctx_request_id=f"ctx-{req.request_id}",
                              ctx_endpoint="tcp://127.0.0.1:5555", ctx_epoch="epoch-1",
                              first_gen_tokens=tuple(a[0][0] for a in answers),
                              prompt_token_ids=tuple(req.prompt_token_ids))
        return {"finish_reason": "length", "disagg": disagg}


def _is_context_only(req: GenerateRequest) -> bool:
    return req.disagg is not None and req.disagg.request_type == "context_only"


def _first_gen(req: GenerateRequest) -> tuple[int, ...] | None:
    disagg = req.disagg
    if disagg is None or disagg.request_type != "generation_only" or not disagg.first_gen_tokens:
        return None
    return disagg.first_gen_tokens


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


def sse_chunks(response) -> list[dict]:
    """A streamed answer's chunks: status 200, the SSE framing exact (`sse_events`), `[DONE]` last."""
    assert response.status_code == 200, response.text
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


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
    from server.api.app import create_app

    return create_app(engine_factory, auth_token=TOKEN, context_directory=directory or KnownEndpoints())
