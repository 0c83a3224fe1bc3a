"""Plain data exchanged between the HTTP layer, the engine and the router (no torch: these cross
threads and are turned into JSON)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

from server.openai.protocol import DisaggParams, RequestType

__all__ = ["DisaggParams", "EngineClient", "GenerateRequest", "LinkState", "RequestOutput",
           "RequestType", "SamplingParams", "StructuredSpec", "TokenLogprob"]

FinishReason = Literal["stop", "length", "abort", "error"]
DEFAULT_RETENTION_PRIORITY = 35  # TensorRT-LLM's default KV retention priority


@dataclass(frozen=True)
class StructuredSpec:
    """A constraint on the output: `kind` "json_object" (any JSON object), "json_schema" (`spec` is
    the schema as JSON text), "regex" (`spec` a regular expression), "choice" (`spec` a JSON list of
    strings), "grammar" (`spec` an EBNF/Lark grammar)."""

    kind: Literal["json_object", "json_schema", "regex", "choice", "grammar"]
    spec: str = ""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings (OpenAI fields plus vLLM's extras). Log-probabilities are those
    of the raw logits, before penalties, biases, temperature, top-k/top-p/min-p and grammar masks."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0  # 0: off; else drop tokens whose probability is below min_p x the top token's
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False
    n: int = 1  # choices; they share the prompt's KV blocks (forked after the prompt is computed)
    logprobs: int | None = None  # None: off; k >= 0: each sampled token's logprob and its top k alternatives
    prompt_logprobs: int | None = None  # None: off; k >= 0: the same for every prompt token (echo)
    presence_penalty: float = 0.0  # OpenAI: subtracted once from tokens that appear in the output
    frequency_penalty: float = 0.0  # OpenAI: subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # vLLM/transformers: tokens in prompt or output, divided (>0) or multiplied
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    structured: StructuredSpec | None = None  # output constrained by a grammar

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass
class GenerateRequest:
    """One request as the engine receives it: tokens already known."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    disagg: DisaggParams | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None  # prefix-cache namespace: blocks are shared only under equal salts
    kv_retention_priority: int = DEFAULT_RETENTION_PRIORITY  # 0..100: evicted last when high


@dataclass(frozen=True)
class TokenLogprob:
    """One position's log-probability: the token there, its logprob, and the `top` most likely
    tokens of that position as (token id, logprob), most likely first (as many as were asked)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """One increment of one choice (`index`) of a request's output; each choice's last has `finished=True`.

    `new_token_ids`/`new_text` are what is new since the choice's previous output; counters are
    cumulative. `logprobs` has one entry per new token; `prompt_logprobs` comes on a choice's first
    output, None for the first prompt token."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    error_code: int = 500  # HTTP status to use when finish_reason == "error"
    disagg: DisaggParams | None = None  # set on the final output of a context_only request
    index: int = 0  # the choice (n > 1)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


class EngineClient(Protocol):
    """What the HTTP layer needs from an engine (on a thread or in a process: server/engine_host/)."""

    model_name: str
    max_seq_len: int

    @property
    def tokenizer(self):  # transformers PreTrainedTokenizerBase
        ...

    @property
    def vocab_size(self) -> int:
        """Rows of the model's embedding: the bound of every token id a request may carry (it can
        exceed len(tokenizer): models pad their vocabulary, and sample ids the tokenizer lacks)."""
        ...

    def is_ready(self) -> bool: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Submit and stream outputs. Closing the iterator early aborts the request and frees its blocks."""
        ...

    async def abort(self, request_id: str) -> None: ...


@dataclass(frozen=True)
class LinkState:
    """A server's KV transceiver as `/health` and the KV routes see it (server/api/routes/health.py)."""

    dead: tuple[str, ...] = ()  # socket threads that died: no KV transfer can run
    peers: dict[str, str] | None = None  # a generation server's handshakes: KV endpoint -> state
    sender: tuple[str, str] | None = None  # a context server's KV sender: (endpoint, epoch)
    sender_endpoints: tuple[str, ...] = ()  # a tensor-parallel context server's: every rank's, rank 0's first

