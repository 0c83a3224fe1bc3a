"""OpenAI request bodies for /v1/completions and /v1/chat/completions (pydantic v2), and the
disaggregation legs' `DisaggParams`.

Every field is declared: implemented, accepted, or refused with a 400 naming it (fields.py;
docs/API.md lists them). Checks that need the server or cross fields are in server/api/builder.py."""

from __future__ import annotations

from operator import not_
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, TypeAdapter, field_validator, model_validator
from pydantic.dataclasses import dataclass

from server.openai.fields import Lenient, one_of, refused

MAX_LOGPROBS = 20  # OpenAI's bound on chat top_logprobs; pdserve uses it for completions' logprobs too
GUIDED = ("json", "regex", "choice", "grammar")  # vLLM's older `guided_*` constraint fields
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function (and response format) names


class StreamOptions(Lenient):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted, ignored: no obfuscation padding is added


RequestType = Literal["context_only", "generation_only", "context_and_generation"]
# A token's log-probability in a compact JSON form: [token id, logprob, [[id, logprob], ...]] (the top ones)
CompactLogprob = tuple[int, float, tuple[tuple[int, float], ...]]


@dataclass(frozen=True, config=ConfigDict(extra="ignore", coerce_numbers_to_str=True))  # TRT-LLM sends int ids
class DisaggParams:
    """TensorRT-LLM's `disaggregated_params` (the fields pdserve uses): the one shape the router sends,
    the API validates, the engine reads and the context server answers with."""

    request_type: RequestType
    ctx_request_id: str | None = None
    ctx_endpoint: str | None = None
    ctx_epoch: str | None = None
    first_gen_tokens: tuple[int, ...] | None = None  # one per choice (n)
    prompt_token_ids: tuple[int, ...] | None = None
    ctx_cached_tokens: int = Field(default=0, ge=0)  # prefix-cache hit on the context server (honest usage)
    # Set by the router on requests only (left out of a body while unset), but cache_salt:
    # generation_only: the router already streamed the text of first_gen_tokens (and a chat role
    # chunk) under the id continued_response_id(ctx_request_id); stream only what follows, under it
    first_text_streamed: bool = Field(default=False, exclude_if=not_)
    # the cache_salt the context server hashed the prompt's blocks with: the generation server
    # reuses its own cache, and pulls, under the same one
    cache_salt: str | None = None
    # Migration (the router moves a stream whose generation server died, server/router/migration.py):
    # the last `prior_output_tokens` prompt tokens are the request's output so far, their text already
    # streamed; max_tokens/min_tokens count them, text and usage are reported relative to them.
    prior_output_tokens: int = Field(default=0, ge=0, exclude_if=not_)
    response_id: str | None = Field(default=None, exclude_if=not_)  # generation_only: the stream to continue
    report_tokens: bool = Field(default=False, exclude_if=not_)  # streamed: token ids in an SSE comment
    # KV streamed while the prompt is prefilled (server/api/generation.py). context_only: the router
    # takes the early answer (the lease before the first token); the context server decides. generation_only:
    # the pull starts at once, and the first token (no first_gen_tokens) comes with the last of the KV.
    kv_stream: bool = Field(default=False, exclude_if=not_)
    # Log-probabilities only the context server can compute, in its answer (server/api/disagg_logprobs.py):
    # first_gen_logprobs one per choice, its first token's; prompt_logprobs echo's, the first null.
    first_gen_logprobs: tuple[CompactLogprob, ...] | None = Field(default=None, exclude_if=not_)
    prompt_logprobs: tuple[CompactLogprob | None, ...] | None = Field(default=None, exclude_if=not_)


DISAGG_PARAMS = TypeAdapter(DisaggParams)  # validates and dumps it outside a request model
Penalty = Annotated[float | None, Field(ge=-2.0, le=2.0)]
Schema = dict[str, Any] | str  # a JSON schema, as an object or as JSON text


# ---- chat messages (with tool calls and results) and function tools

class TextPart(Lenient):
    type: str
    text: str | None = None


Content = Annotated[str | list[TextPart] | None, one_of("a string or a list of text parts")]


class CalledFunction(Lenient):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(Lenient):
    """A call an assistant made in an earlier turn."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Lenient):
    role: str
    content: Content = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this is the result of
    function_call: refused(hint="; send tool_calls") = None
    audio: refused() = None
    refusal: refused() = None

    @field_validator("role")
    @classmethod
    def _no_function_role(cls, role: str) -> str:
        if role == "function":
            raise ValueError("role 'function' (the deprecated function calling) is not supported; use "
                             "role 'tool' with tool_call_id")
        return role


class FunctionDefinition(Lenient):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: a function without arguments
    strict: bool | None = None  # the arguments always follow `parameters` when it is forced (tool_choice)


class Tool(Lenient):
    type: str
    function: FunctionDefinition | None = None

    @model_validator(mode="after")
    def _function_tool(self) -> Tool:
        if self.type != "function":
            raise ValueError(f"only function tools are supported by pdserve (this one is {self.type!r})")
        if self.function is None:
            raise ValueError("a function tool needs its function")
        return self


class ChosenFunction(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Annotated[Literal["none", "auto", "required"] | NamedToolChoice | None,
                       one_of('"none", "auto", "required" or {"type": "function", "function": {"name": ...}}')]


# ---- structured output: OpenAI's `response_format` and vLLM's `structured_outputs` (server/api/structured.py
# turns them into the engine's `StructuredSpec`)

class JSONSchemaFormat(Lenient):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # none: any JSON object
    strict: bool | None = None  # the output always follows the schema here, strict or not


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is required with type "json_schema", and only with it')
        return self


class StructuredOutputs(Lenient):
    """vLLM's `structured_outputs`: exactly one of the constraints."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")  # a JSON schema (object or text)
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None  # EBNF / Lark
    json_object: bool | None = None
    structural_tag: refused() = None
    whitespace_pattern: refused() = None
    disable_fallback: refused(False) = None
    disable_any_whitespace: refused(False) = None
    disable_additional_properties: refused(False) = None

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        chosen = [name for name, _ in self.chosen()]
        if len(chosen) != 1:
            raise ValueError("set exactly one of json, regex, choice, grammar, json_object "
                             f"(got {', '.join(chosen) or 'none'})")
        return self

    def chosen(self) -> list[tuple[str, Any]]:
        """(name, value) of each constraint set."""
        constraints = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                       "json_object": self.json_object}
        return [(name, value) for name, value in constraints.items() if value not in (None, False)]


class SamplingRequest(Lenient):
    """Fields shared by completions and chat requests."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1)  # the server's maximum: server.api.builder
    seed: int | None = None
    stop: Annotated[str | list[str] | None, one_of("a string or a list of strings")] = None
    max_tokens: int | None = Field(default=None, ge=1)
    presence_penalty: Penalty = None
    frequency_penalty: Penalty = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None  # token id -> bias
    user: str | None = None  # accepted, ignored: an end-user id for abuse monitoring
    response_format: ResponseFormat | None = None  # OpenAI's (chat); vLLM takes it in completions too
    # vLLM extras
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    stop_token_ids: list[int] | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: Schema | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted, ignored: pdserve has one grammar engine
    # vLLM extras pdserve does not implement
    use_beam_search: refused(False) = None
    length_penalty: refused(1.0) = None
    bad_words: refused([]) = None
    allowed_token_ids: refused() = None
    prompt_logprobs: refused(hint="; completions: use echo with logprobs") = None
    include_stop_str_in_output: refused(False) = None
    skip_special_tokens: refused(True) = None
    spaces_between_special_tokens: refused(True) = None
    truncate_prompt_tokens: refused() = None
    logits_processors: refused() = None
    return_tokens_as_token_ids: refused(False) = None
    guided_whitespace_pattern: refused() = None
    priority: refused(0) = None
    # vLLM's prefix-cache namespace: requests share cached blocks only under equal salts
    cache_salt: str | None = None
    # retention priority of the request's KV blocks: 0..100, evicted lowest first; evicted blocks of
    # priority >= kv_cache_config.secondary_offload_min_priority go to the host tier. Default 35.
    kv_retention_priority: int | None = Field(default=None, ge=0, le=100)
    # TensorRT-LLM's disaggregation extension
    disaggregated_params: DisaggParams | None = None

    @field_validator("cache_salt")
    @classmethod
    def _salt_not_empty(cls, salt: str | None) -> str | None:
        if salt is not None and not salt:
            raise ValueError("cache_salt must be a non-empty string if provided")
        return salt

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or ():
            if not key.isdecimal():
                raise ValueError(f"keys must be token ids (decimal integers), got {key!r}")
        return bias

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def constrained(self) -> bool:
        """The request names a structured-output constraint (compiling its grammar runs off the event loop)."""
        fmt = self.response_format
        return (fmt is not None and fmt.type != "text") or self.structured_outputs is not None or any(
            getattr(self, f"guided_{key}") is not None for key in GUIDED)


class CompletionRequest(SamplingRequest):
    # A string or token ids, or a list of several of those (one engine request each).
    prompt: Annotated[str | list[int] | list[str] | list[list[int]],
                      one_of("a string, a list of token ids, or a list of strings or of token-id lists")]
    max_tokens: int | None = Field(default=None, ge=0)  # 0: only with echo (the prompt's logprobs)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1)  # must equal n: server.api.builder
    suffix: refused("") = None
    add_special_tokens: refused(True) = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # needs logprobs: true
    tools: list[Tool] | None = None
    tool_choice: ToolChoice = None  # none: "auto" with tools, else "none"
    parallel_tool_calls: bool | None = None
    # OpenAI's, accepted and ignored: they change no output
    metadata: dict[str, str] | None = None
    store: refused(False, hint="; pdserve stores no completions") = None
    service_tier: refused("auto", "default") = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # a routing hint; pdserve's prefix cache needs none
    prompt_cache_retention: refused("in_memory") = None
    prompt_cache_options: refused({"mode": "implicit"}) = None
    verbosity: refused("medium") = None
    # OpenAI's, refused: not implemented
    audio: refused() = None
    modalities: refused(["text"]) = None
    prediction: refused() = None
    web_search_options: refused() = None
    reasoning_effort: refused() = None
    moderation: refused() = None
    functions: refused(hint="; use tools") = None
    function_call: refused(hint="; use tool_choice") = None
    # vLLM's chat extras pdserve does not implement
    echo: refused(False) = None
    add_generation_prompt: refused(True) = None
    continue_final_message: refused(False) = None
    add_special_tokens: refused(False) = None
    chat_template: refused() = None
    chat_template_kwargs: refused() = None
    documents: refused() = None
    mm_processor_kwargs: refused() = None

    @property
    def constrained(self) -> bool:
        """Also when the tools may force calls (`tool_choice` required or a named function)."""
        return super().constrained or bool(self.tools and self.tool_choice not in (None, "none", "auto"))

    @property
    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` (the newer name) wins over `max_tokens`."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
