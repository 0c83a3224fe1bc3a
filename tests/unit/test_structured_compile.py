"""Structured output's pieces on builtin:tiny-llama's tokenizer: each kind of spec compiles and its
matcher follows a valid output to completion (then only EOS is allowed), bad specs raise ValueErrors
naming the problem, the compile cache hits and evicts, whitespace between JSON elements is never
allowed, ids past the tokenizer never are, and a step's bitmask masks exactly its constrained rows."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from server.engine.structured.bitmask import StepMask
from server.engine.structured.compiler import GrammarCompiler, check_spec
from server.models.builtin import resolve_model
from server.types import StructuredSpec

EOS = 2  # the tiny tokenizer's <|eos|>
VOCAB = 512


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model("builtin:tiny-llama"))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB, [EOS])


def allowed(grammar, vocab: int = VOCAB) -> set[int]:
    row = torch.zeros((vocab + 31) // 32, dtype=torch.int32)
    grammar.fill(row)
    return set(np.flatnonzero(np.unpackbits(row.numpy().view(np.uint8), bitorder="little")).tolist())


def feed(grammar, tokenizer, text: str) -> bool:
    return all(grammar.accept(t) for t in tokenizer.encode(text, add_special_tokens=False))


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "c": {"enum": ["red", "blue"]}},
          "required": ["n", "c"], "additionalProperties": False}
VALID = [
    (StructuredSpec("json_object"), '{"a":[1,{"b":null}],"c":"x"}'),
    (StructuredSpec("json_schema", json.dumps(SCHEMA)), '{"n":-12,"c":"blue"}'),
    (StructuredSpec("regex", r"[a-z]{2}-\d{3}"), "ab-123"),
    (StructuredSpec("choice", json.dumps(["yes", "no", "maybe"])), "maybe"),
    (StructuredSpec("grammar", 'root ::= "x" digit digit\ndigit ::= [0-9]'), "x42"),
    (StructuredSpec("grammar", 'start: "(" NAME ")"\nNAME: /[a-z]+/'), "(abc)"),
]


@pytest.mark.parametrize(("spec", "text"), VALID, ids=[f"{s.kind}-{i}" for i, (s, _) in enumerate(VALID)])
def test_a_valid_output_completes_its_grammar_and_then_only_eos_is_allowed(compiler, tokenizer, spec, text):
    grammar = compiler.compile(spec).matcher()
    assert grammar.ending() is None
    assert feed(grammar, tokenizer, text)
    assert grammar.ending() == ("stop",)
    assert allowed(grammar) == {EOS}


def test_a_refused_token_ends_the_request_with_an_error_and_a_fork_is_independent(compiler, tokenizer):
    spec = StructuredSpec("choice", '["yes", "no"]')
    fresh, grammar = compiler.compile(spec).matcher(), compiler.compile(spec).matcher()
    fork = grammar.fork()
    assert feed(grammar, tokenizer, "no") and grammar.ending() == ("stop",)
    assert fork.ending() is None and allowed(fork) == allowed(fresh) != {EOS}
    token = tokenizer.encode("x", add_special_tokens=False)[0]
    assert not fork.accept(token)
    assert fork.ending() == ("error", f"token {token} does not match the output's grammar", 500)
    assert grammar.ending() == ("stop",)


BAD = [
    (StructuredSpec("json_schema", "{not json"), "invalid json_schema: not JSON"),
    (StructuredSpec("json_schema", "[1, 2]"), "invalid json_schema: a schema is a JSON object"),
    (StructuredSpec("json_schema", '{"type": "objectx"}'), "objectx"),
    (StructuredSpec("json_schema", '{"type": "string", "minLength": 5, "maxLength": 2}'),
     "minLength (5) is greater than maxLength (2)"),
    (StructuredSpec("json_schema", '{"$ref": "#/$defs/missing"}'), "/$defs/missing"),
    (StructuredSpec("json_schema", '{"type": "string", "format": "uri-reference"}'), "uri-reference"),
    (StructuredSpec("regex", "a(b"), "unclosed group"),
    (StructuredSpec("choice", "[]"), "invalid choice: a non-empty list of non-empty strings"),
    (StructuredSpec("choice", '"yes"'), "invalid choice: a non-empty list of non-empty strings"),
    (StructuredSpec("grammar", "root ::= missing"), "invalid grammar: Rule 'missing' not found"),
    (StructuredSpec("grammar", "start: NUM\nNUM: /[0-9/"), "unclosed character class"),
]


@pytest.mark.parametrize(("spec", "message"), BAD, ids=[f"{s.kind}-{i}" for i, (s, _) in enumerate(BAD)])
def test_an_invalid_spec_raises_a_value_error_naming_the_problem(tokenizer, spec, message):
    with pytest.raises(ValueError) as raised:
        check_spec(spec, tokenizer)
    assert message in str(raised.value) and str(raised.value).startswith(f"invalid {spec.kind}: ")


def test_the_compile_cache_hits_and_evicts_the_least_recently_used(tokenizer):
    compiler = GrammarCompiler(tokenizer, VOCAB, [EOS], capacity=2)
    a, b, c = (StructuredSpec("regex", r) for r in ("a+", "b+", "c+"))
    first_a = compiler.compile(a)
    compiler.compile(b)
    assert compiler.compile(a) is first_a and (compiler.hits, compiler.misses) == (1, 2)
    compiler.compile(c)  # evicts b, the least recently used
    assert compiler.compile(a) is first_a and (compiler.hits, compiler.misses) == (2, 3)
    compiler.compile(b)
    assert (compiler.hits, compiler.misses) == (2, 4)
    assert compiler.compile(StructuredSpec("json_object", "a+")) is not first_a  # the kind is part of the key


def test_check_spec_uses_one_cached_compiler_per_tokenizer(tokenizer):
    from server.engine.structured.compiler import compiler_for

    spec = StructuredSpec("regex", "[0-9]{4}")
    check_spec(spec, tokenizer)
    compiler = compiler_for(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    hits = compiler.hits
    check_spec(spec, tokenizer)
    assert compiler.hits == hits + 1


def test_json_whitespace_is_strict(compiler, tokenizer):
    blank = {t for t in range(len(tokenizer)) if tokenizer.decode([t]) and not tokenizer.decode([t]).strip()}
    assert blank, "the tiny vocabulary has whitespace tokens"
    for spec in (StructuredSpec("json_object"), StructuredSpec("json_schema", json.dumps(SCHEMA))):
        grammar = compiler.compile(spec).matcher()
        for piece in ('{', '"n"', ':', '-12', ',', '"c"', ':', '"red"', '}'):
            assert not allowed(grammar) & blank, f"{spec.kind}: whitespace allowed before {piece!r}"
            assert feed(grammar, tokenizer, piece)
        assert grammar.ending() == ("stop",)


def test_ids_past_the_tokenizer_are_never_allowed(tokenizer):
    wide = GrammarCompiler(tokenizer, 600, [EOS])  # the model's logits are wider than its tokenizer
    grammar = wide.compile(StructuredSpec("json_object")).matcher()
    assert feed(grammar, tokenizer, '{"k":"')  # inside a string: nearly every token may come
    inside = allowed(grammar, 600)
    assert len(inside) > 300 and max(inside) < VOCAB


def test_a_step_mask_sets_the_refused_tokens_of_its_constrained_rows_to_minus_inf(compiler, tokenizer):
    grammars = {1: compiler.compile(StructuredSpec("choice", '["yes", "no"]')).matcher(),
                3: compiler.compile(StructuredSpec("regex", "[0-9]+")).matcher()}
    logits = torch.randn(4, VOCAB)
    raw = logits.clone()
    masked = StepMask.fill(grammars, 4, VOCAB, torch.device("cpu")).apply(logits)
    assert torch.equal(logits, raw)  # the raw logits stay (logprobs read them)
    for row in range(4):
        keep = allowed(grammars[row]) if row in grammars else set(range(VOCAB))
        expected = torch.full((VOCAB,), float("-inf"))
        expected[sorted(keep)] = raw[row, sorted(keep)]
        assert torch.equal(masked[row], expected), row
    one = StepMask.fill({0: grammars[3]}, 1, VOCAB, torch.device("cpu")).apply(raw[:1])  # one row: no pool
    assert torch.equal(one[0].isfinite().nonzero().view(-1), torch.tensor(sorted(allowed(grammars[3]))))
