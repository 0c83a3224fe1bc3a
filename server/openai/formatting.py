"""Engine outputs -> OpenAI JSON, for completions and chat, whole responses and stream chunks.

Chunks of different choices may interleave. A token without text yet has its log-probabilities go
with the choice's next chunk, so the chunks add up to the whole response."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from server.openai.logprobs import (
    TextOffsets,
    TokenPieces,
    add_completion_logprobs,
    aligned,
    chat_logprobs,
)
from server.openai.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    FunctionOut,
    PromptTokensDetails,
    ToolCallOut,
    Usage,
)
from server.openai.tool_parsers import CallArguments, CallStart, Content, Event, ToolParser, make_parser
from server.types import RequestOutput, TokenLogprob


def continued_response_id(ctx_request_id: str) -> str:
    """The id of a stream the router opened from a context answer and a generation server continues:
    derived from the context request id, not equal to it (that id is the key of the KV lease)."""
    prefix = ctx_request_id.split("-", 1)[0] if "-" in ctx_request_id else "cmpl"
    return f"{prefix}-{hashlib.blake2b(ctx_request_id.encode(), digest_size=16).hexdigest()}"


@dataclass(frozen=True)
class Echo:
    """Completions' `echo`: a prompt's text and token ids, put before its choices' text."""

    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ToolMode:
    """How chat output becomes tool calls: `mode` "hermes" | "llama3_json" (the model's format,
    `tool_choice: "auto"`), "named" (`function`'s arguments), "required" (an array of calls)."""

    mode: str
    function: str | None = None
    parallel: bool = True


@dataclass(frozen=True)
class FormatOptions:
    n: int = 1  # choices per prompt
    logprobs: int | None = None  # completions: `logprobs`; chat: `top_logprobs` (0 for `logprobs: true`)
    echo: tuple[Echo, ...] = ()  # completions: one per prompt
    pieces: TokenPieces | None = None  # token id -> text and bytes (with logprobs)
    tools: ToolMode | None = None  # chat


@dataclass
class _ChoiceState:
    started: bool = False  # its first output was formatted (role chunk, echo)
    offsets: TextOffsets = field(default_factory=TextOffsets)
    pending_ids: list[int] = field(default_factory=list)  # tokens whose logprobs no chunk carried yet
    pending: list[TokenLogprob | None] = field(default_factory=list)
    parser: ToolParser | None = None

    def hold(self, output: RequestOutput) -> None:
        self.pending_ids += output.new_token_ids
        self.pending += aligned(output.new_token_ids, output.logprobs)

    def take(self) -> tuple[list[int], list[TokenLogprob | None]]:
        out = self.pending_ids, self.pending
        self.pending_ids, self.pending = [], []
        return out


class UsageTally:
    """Usage over every choice: each prompt once (choice index // n), each choice's completion tokens."""

    def __init__(self, n: int = 1) -> None:
        self._n = n
        self._prompts: dict[int, tuple[int, int]] = {}
        self._completions: dict[int, int] = {}

    def observe(self, output: RequestOutput) -> None:
        self._prompts[output.index // self._n] = (output.prompt_tokens, output.cached_tokens)
        self._completions[output.index] = output.completion_tokens

    def usage(self) -> Usage:
        prompt = sum(p for p, _ in self._prompts.values())
        completion = sum(self._completions.values())
        cached = sum(c for _, c in self._prompts.values())
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class _Formatter:
    """`continued`: someone else (the router) opened this stream: the chat role chunk and echo were sent."""

    _chunk_body: type[CompletionResponse | ChatCompletionChunk]  # a stream chunk, the usage chunk's too
    _whole_body: type[CompletionResponse | ChatCompletionResponse]

    def __init__(self, response_id: str, model: str, include_usage: bool = False, continued: bool = False,
                 options: FormatOptions | None = None):
        self.response_id = response_id
        self.model = model
        self.include_usage = include_usage
        self.options = options or FormatOptions()
        self._continued = continued
        self._states: dict[int, _ChoiceState] = {}
        self._usage = UsageTally(self.options.n)

    def _new_state(self) -> _ChoiceState:
        tools = self.options.tools
        return _ChoiceState(parser=make_parser(tools.mode, tools.function, tools.parallel) if tools else None)

    def _state(self, index: int) -> _ChoiceState:
        if index not in self._states:
            self._states[index] = self._new_state()
        return self._states[index]

    def _finish(self, output: RequestOutput, state: _ChoiceState) -> str | None:
        if not output.finished:
            return None
        calls = state.parser is not None and state.parser.calls > 0
        return "tool_calls" if calls and output.finish_reason == "stop" else output.finish_reason

    def _choice(self, output: RequestOutput, state: _ChoiceState) -> CompletionChoice | ChatChoice | None:
        raise NotImplementedError

    def _stream_chunk(self, choices: list, usage: Usage | None = None) -> str:
        return self._chunk_body(id=self.response_id, model=self.model, choices=choices, usage=usage).model_dump_json()

    def usage_chunk(self, final: RequestOutput) -> str:
        """`final`: the request's last output; the usage counts every choice seen."""
        self._usage.observe(final)
        return self._stream_chunk([], self._usage.usage())

    def response(self, choices: Sequence[RequestOutput]) -> str:
        """The whole body from each choice's merged output (server/api/generation.py `_merged`)."""
        tally = UsageTally(self.options.n)
        bodies = []
        for output in sorted(choices, key=lambda o: o.index):
            tally.observe(output)
            bodies.append(self._choice(output, self._new_state()))
        body = self._whole_body(id=self.response_id, model=self.model, choices=bodies, usage=tally.usage())
        return body.model_dump_json()


class CompletionFormatter(_Formatter):
    _chunk_body = _whole_body = CompletionResponse

    def chunks(self, output: RequestOutput) -> list[str]:
        self._usage.observe(output)
        choice = self._choice(output, self._state(output.index))
        if choice is None:
            return []  # tokens without text yet (an incomplete UTF-8 sequence)
        return [self._stream_chunk([choice])]

    def _choice(self, output: RequestOutput, state: _ChoiceState) -> CompletionChoice | None:
        echo = self._echo(state, output.index)
        text = output.new_text if echo is None else echo.text + output.new_text
        wanted = self.options.logprobs is not None
        if wanted:
            state.hold(output)
        if not text and not output.finished:
            return None
        logprobs = None
        if wanted:
            logprobs = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
            if echo is not None:
                prompt = aligned(echo.token_ids, output.prompt_logprobs)
                add_completion_logprobs(logprobs, echo.token_ids, prompt, self.options.pieces, state.offsets)
                state.offsets.resync(len(echo.text))
            add_completion_logprobs(logprobs, *state.take(), self.options.pieces, state.offsets)
        return CompletionChoice(index=output.index, text=text, logprobs=logprobs,
                                finish_reason=self._finish(output, state), disaggregated_params=output.disagg)

    def _echo(self, state: _ChoiceState, index: int) -> Echo | None:
        first, state.started = not state.started, True
        if not first or self._continued or not self.options.echo:
            return None
        return self.options.echo[index // self.options.n]


class ChatFormatter(_Formatter):
    """Chat chunks: each choice's first carries `role`, its last `finish_reason` (OpenAI's delta shape)."""

    _chunk_body = ChatCompletionChunk
    _whole_body = ChatCompletionResponse

    def _chunk(self, index: int, delta: ChatDelta, logprobs: ChatLogprobs | None = None,
               output: RequestOutput | None = None, finish: str | None = None) -> str:
        choice = ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish,
                                 disaggregated_params=output.disagg if output is not None else None)
        return self._stream_chunk([choice])

    def chunks(self, output: RequestOutput) -> list[str]:
        self._usage.observe(output)
        state = self._state(output.index)
        out = []
        if not state.started:
            state.started = True
            if not self._continued:
                out.append(self._chunk(output.index, ChatDelta(role="assistant", content="")))
        if self.options.logprobs is not None:
            state.hold(output)
        deltas = self._deltas(output, state)
        if output.finished and not deltas:
            deltas = [ChatDelta()]
        for i, delta in enumerate(deltas):
            logprobs = self._logprobs(*state.take()) if i == 0 and self.options.logprobs is not None else None
            last = i == len(deltas) - 1
            out.append(self._chunk(output.index, delta, logprobs, output if last else None,
                                   self._finish(output, state) if last else None))
        return out

    def _deltas(self, output: RequestOutput, state: _ChoiceState) -> list[ChatDelta]:
        if state.parser is None:
            return [ChatDelta(content=output.new_text)] if output.new_text else []
        events = state.parser.feed(output.new_text) + (state.parser.finish() if output.finished else [])
        return [_delta(event) for event in _merged(events)]

    def _logprobs(self, token_ids: list[int], entries: list[TokenLogprob | None]) -> ChatLogprobs:
        return ChatLogprobs(content=chat_logprobs(token_ids, entries, self.options.pieces, self.options.logprobs))

    def _choice(self, output: RequestOutput, state: _ChoiceState) -> ChatChoice:
        message = ChatMessageOut(content=output.new_text)
        if state.parser is not None:
            message = tool_message(state.parser.feed(output.new_text) + state.parser.finish())
        logprobs = None
        if self.options.logprobs is not None:
            logprobs = self._logprobs(output.new_token_ids, aligned(output.new_token_ids, output.logprobs))
        return ChatChoice(index=output.index, message=message, logprobs=logprobs,
                          finish_reason=self._finish(output, state), disaggregated_params=output.disagg)


Formatter = CompletionFormatter | ChatFormatter


# ---- tool-call events (server/openai/tool_parsers.py) as a message's `tool_calls` or stream deltas (ToolCallOut)

def _started(call: CallStart, index: int | None = None) -> ToolCallOut:
    """A call's first part: its id, type and function name (`index` in stream deltas only)."""
    return ToolCallOut(index=index, id=f"call_{uuid.uuid4().hex[:24]}", type="function",
                       function=FunctionOut(name=call.name, arguments=""))


def _merged(events: list[Event]) -> list[Event]:
    """The events with each run of content, or of one call's arguments, as one (one stream delta each)."""
    out: list[Event] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, Content) and isinstance(last, Content):
            out[-1] = Content(last.text + event.text)
        elif isinstance(event, CallArguments) and isinstance(last, CallArguments) and last.index == event.index:
            out[-1] = CallArguments(event.index, last.text + event.text)
        else:
            out.append(event)
    return out


def _delta(event: Event) -> ChatDelta:
    if isinstance(event, Content):
        return ChatDelta(content=event.text)
    if isinstance(event, CallStart):
        return ChatDelta(tool_calls=[_started(event, event.index)])
    return ChatDelta(tool_calls=[ToolCallOut(index=event.index, function=FunctionOut(arguments=event.text))])


def tool_message(events: list[Event]) -> ChatMessageOut:
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls: dict[int, ToolCallOut] = {}
    for event in events:
        if isinstance(event, CallStart):
            calls[event.index] = _started(event)
        elif isinstance(event, CallArguments):
            calls[event.index].function.arguments += event.text
    if not calls:
        return ChatMessageOut(content=content)
    return ChatMessageOut(content=content or None, tool_calls=[calls[i] for i in sorted(calls)])
