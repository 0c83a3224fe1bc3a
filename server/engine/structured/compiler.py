"""A `StructuredSpec` compiled into a grammar for one model's tokenizer, with llguidance (docs/API.md,
"Structured output", says why this engine). JSON is compiled without whitespace between elements, so
no output can loop on whitespace (a random-weight model would). A grammar is compiled for the width
of the model's logits, which can exceed the tokenizer: ids past it have no bytes, so no grammar allows
them. Compiled grammars are kept in a bounded LRU keyed by (kind, spec); each request matches with a
copy (`CompiledGrammar.matcher`).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import llguidance.hf
from llguidance.gbnf_to_lark import any_to_lark

from server.engine.structured.matcher import RequestGrammar
from server.types import StructuredSpec

CACHE_SIZE = 256  # compiled grammars kept per tokenizer
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: no whitespace between elements
LIMITS = llguidance.LLParserLimits(verbose_errors=False)  # errors name the problem, not the parser's state
MAX_MESSAGE = 400


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    template: llguidance.LLMatcher  # in its start state, never fed: each request takes a copy

    def matcher(self) -> RequestGrammar:
        return RequestGrammar(self.template.deep_copy())


class GrammarCompiler:
    """Compiles specs for one tokenizer and logits width, and keeps the last `capacity` compiled."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], capacity: int = CACHE_SIZE) -> None:
        self.tokenizer = tokenizer  # kept: `compiler_for` keys compilers by its id
        self.vocab_size = vocab_size
        try:
            self.lltokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                           eos_token=list(eos_token_ids) or None)
        except Exception as error:  # noqa: BLE001 (a slow tokenizer, or one llguidance cannot read)
            raise ValueError(f"structured output is not available for this model's tokenizer: {error}") from error
        self.capacity = capacity
        self.hits = self.misses = 0
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()  # the HTTP side checks specs while the engine thread compiles

    def compile(self, spec: StructuredSpec) -> CompiledGrammar:
        """The spec's compiled grammar (cached); ValueError naming the problem when it is invalid."""
        key = (spec.kind, spec.spec)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return compiled
        compiled = CompiledGrammar(self._build(spec))  # outside the lock: llguidance drops the GIL
        with self._lock:
            self.misses += 1
            self._cache[key] = compiled
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return compiled

    def _build(self, spec: StructuredSpec) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.lltokenizer, grammar_text(spec), log_level=0, limits=LIMITS)
        if matcher.is_error():
            raise ValueError(f"invalid {spec.kind}: {_short(matcher.get_error())}")
        return matcher


def grammar_text(spec: StructuredSpec) -> str:
    """llguidance's grammar for `spec` (ValueError for a spec that is not even well-formed)."""
    kind, text = spec.kind, spec.spec
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if kind == "json_schema":
        schema = _parse(text, kind)
        if not isinstance(schema, dict | bool):
            raise ValueError("invalid json_schema: a schema is a JSON object")
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        choices = _parse(text, kind)
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("invalid choice: a non-empty list of non-empty strings")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if kind == "grammar":
        try:
            lark = any_to_lark(text)  # GBNF/EBNF (`root ::= ...`) or Lark
        except Exception as error:  # noqa: BLE001 (the converter raises plain Exceptions)
            raise ValueError(f"invalid grammar: {_short(str(error))}") from error
        return llguidance.LLMatcher.grammar_from_lark(lark)
    raise ValueError(f"unknown structured output kind {kind!r}")


def _parse(text: str, kind: str):
    try:
        return json.loads(text)
    except ValueError as error:
        raise ValueError(f"invalid {kind}: not JSON ({error})") from error


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= MAX_MESSAGE else message[:MAX_MESSAGE] + "..."


MAX_COMPILERS = 8  # a server has one or two (its engine's, its HTTP side's checks); tests make many
_COMPILERS: OrderedDict[tuple[int, int, tuple[int, ...]], GrammarCompiler] = OrderedDict()
_COMPILERS_LOCK = threading.Lock()


def compiler_for(tokenizer, vocab_size: int, eos_token_ids: list[int]) -> GrammarCompiler:
    """The compiler (and cache) of this process for a tokenizer, logits width and EOS ids (the
    tokenizer object's identity: the compiler keeps it, so its id is not reused meanwhile)."""
    key = (id(tokenizer), vocab_size, tuple(sorted(eos_token_ids)))
    with _COMPILERS_LOCK:
        compiler = _COMPILERS.get(key)
        if compiler is None:
            compiler = _COMPILERS[key] = GrammarCompiler(tokenizer, vocab_size, list(key[2]))
            while len(_COMPILERS) > MAX_COMPILERS:
                _COMPILERS.popitem(last=False)
        _COMPILERS.move_to_end(key)
        return compiler


def check_spec(spec: StructuredSpec, tokenizer) -> None:
    """Compile `spec` for `tokenizer` (cached), raising ValueError naming the problem: the HTTP side
    answers 400 with it before the request reaches the engine."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    compiler_for(tokenizer, len(tokenizer), eos).compile(spec)
