"""Structured output through the engine on random-weight models: generated JSON schemas give valid
JSON that finishes ("stop") before max_tokens, greedy and seeded sampled; constrained greedy is token
for token transformers' greedy over the grammar's allowed tokens; async scheduling changes nothing;
json_object, regex, choice and grammar outputs match; a bad spec is refused with a 400."""

from __future__ import annotations

import json
import random
import re

import engine_harness as eh
import hf_reference
import llguidance
import llguidance.hf
import pytest
import torch
from json_schemas import check, random_schema
from transformers import AutoTokenizer

from server.models.builtin import resolve_model
from server.types import GenerateRequest, SamplingParams, StructuredSpec

LLAMA, QWEN = "builtin:tiny-llama", "builtin:tiny-qwen3-swa"
NUM_SCHEMAS = 50
MAX_TOKENS = 300


def schemas() -> list[dict]:
    rng = random.Random(7)
    return [random_schema(rng) for _ in range(NUM_SCHEMAS)]


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 500) for _ in range(rng.randint(3, 12))] for _ in range(n)]


def constrained(spec: StructuredSpec, seed: int | None = None, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    """Greedy without a seed; sampled at temperature 0.8 with one."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0 if seed is None else 0.8, seed=seed, structured=spec)


def as_json(schema: dict) -> StructuredSpec:
    return StructuredSpec("json_schema", json.dumps(schema))


def run(core, requests: list[tuple[list[int], SamplingParams]]) -> list[eh.Result]:
    ids = [eh.submit(core, prompt, params) for prompt, params in requests]
    results = eh.run_to_completion(core, ids)
    return [results[i] for i in ids]


@pytest.mark.parametrize("model", [LLAMA, QWEN])
@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_generated_schemas_give_valid_json_that_finishes(model, mode):
    core = eh.make_core(model, max_batch_size=NUM_SCHEMAS)
    cases = schemas()
    params = [constrained(as_json(s), None if mode == "greedy" else i) for i, s in enumerate(cases)]
    results = run(core, list(zip(prompts(len(cases)), params, strict=True)))
    for i, (schema, result) in enumerate(zip(cases, results, strict=True)):
        assert result.final.finish_reason == "stop", (i, result.text)
        assert len(result.token_ids) < MAX_TOKENS
        check(json.loads(result.text), schema)
    assert len({r.text for r in results}) > NUM_SCHEMAS // 2  # the outputs depend on the schema and prompt
    assert eh.blocks_in_use(core.kv) == 0


def masked_greedy(model: str, prompt: list[int], spec: StructuredSpec, eos: list[int]) -> list[int]:
    """transformers' greedy over the grammar's allowed tokens (llguidance on its own), to the end."""
    model_dir = resolve_model(model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    vocab = hf_reference.hf_model(str(model_dir)).config.vocab_size
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(spec.spec, overrides={"whitespace_flexible": False})
    matcher, out = llguidance.LLMatcher(lltok, grammar), []
    while not matcher.is_stopped():
        bits = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
        allowed = ((bits[:, None] >> torch.arange(8)) & 1).view(-1)[:vocab].bool()
        logits = hf_reference.hf_logits(model_dir, prompt + out)[-1].masked_fill(~allowed, float("-inf"))
        out.append(int(logits.argmax()))
        assert matcher.consume_token(out[-1])
        if out[-1] in eos:
            break
    return out


@pytest.mark.parametrize("model", [LLAMA, QWEN])
def test_constrained_greedy_is_transformers_greedy_over_the_allowed_tokens(model):
    cases, core = schemas()[:4], eh.make_core(model)
    results = run(core, [(p, constrained(as_json(s))) for p, s in zip(prompts(4, seed=5), cases, strict=True)])
    for prompt, schema, result in zip(prompts(4, seed=5), cases, results, strict=True):
        assert result.token_ids == masked_greedy(model, prompt, as_json(schema), sorted(core.eos_token_ids))


def test_async_scheduling_gives_the_same_outputs_beside_unconstrained_requests():
    cases = schemas()[:12]
    requests = [(p, constrained(as_json(s), seed=i if i % 2 else None))
                for i, (p, s) in enumerate(zip(prompts(12, seed=9), cases, strict=True))]
    free = prompts(3, seed=11)
    requests += [(p, eh.greedy(40)) for p in free]  # unconstrained rows of the same steps
    sync, async_ = (run(eh.make_core(LLAMA, async_scheduling=flag), requests) for flag in (False, True))
    assert [r.token_ids for r in async_] == [r.token_ids for r in sync]
    for prompt, result in zip(free, async_[12:], strict=True):
        assert result.token_ids == hf_reference.hf_greedy(resolve_model(LLAMA), prompt, 40)
    for schema, result in zip(cases, async_[:12], strict=True):
        check(json.loads(result.text), schema)


def test_async_constrained_steps_read_their_tokens_while_the_next_forward_runs():
    """A constrained step's tokens are read (and fed to the grammars) after the next step is scheduled
    and its forward queued, as an unconstrained step's are: the host's work overlaps the device's.
    (Reading them before the next schedule left the device idle for all of it: c=64 ran at half the
    plain requests' rate on an H100.)"""
    core, events = eh.make_core(LLAMA, async_scheduling=True), []
    schedule, execute, postprocess = core.scheduler.schedule, core.runner.execute, core._postprocess
    step = core.step
    core.step = lambda: (events.append("|"), step())[1]
    core.scheduler.schedule = lambda: (events.append("S"), schedule())[1]
    core.runner.execute = lambda *a, **k: (events.append("F"), execute(*a, **k))[1]
    core._postprocess = lambda step: (events.append("T"), postprocess(step))[1]
    cases = schemas()[:4]
    results = run(core, [(p, constrained(as_json(s), max_tokens=30))
                         for p, s in zip(prompts(4, seed=3), cases, strict=True)])
    trace = "".join(events)
    assert trace.count("|SFT") >= 10 and "|TSF" not in trace, trace
    sync = run(eh.make_core(LLAMA, async_scheduling=False),
               [(p, constrained(as_json(s), max_tokens=30)) for p, s in zip(prompts(4, seed=3), cases, strict=True)])
    assert [r.token_ids for r in results] == [r.token_ids for r in sync]


def test_regex_choice_and_grammar_outputs_match():
    core = eh.make_core(LLAMA, max_batch_size=32)
    regex, choices = r"[a-z]{2,4}-[0-9]{3}", ["apple", "banana split", "cherry"]
    kinds = [
        (StructuredSpec("regex", regex), lambda t: re.fullmatch(regex, t)),
        (StructuredSpec("choice", json.dumps(choices)), lambda t: t in choices),
        (StructuredSpec("grammar", 'root ::= "(" [a-z] ("," [a-z])? ")"'),
         lambda t: re.fullmatch(r"\([a-z](,[a-z])?\)", t)),
    ]
    seeds = [None, 1, 2, 3]
    requests = [(p, constrained(spec, seed)) for spec, _ in kinds for p, seed in zip(prompts(4, 3), seeds, strict=True)]
    results = run(core, requests)
    for i, result in enumerate(results):
        spec, matches = kinds[i // 4]
        assert result.final.finish_reason == "stop" and matches(result.text), (spec.kind, result.text)


def test_json_object_gives_a_json_object():
    """Its strings are unbounded: a sampled random model may fill max_tokens with one (greedy ends here)."""
    core = eh.make_core(LLAMA, max_batch_size=32)
    requests = [(p, constrained(StructuredSpec("json_object"), seed)) for p in prompts(4, 3) for seed in (None, 1, 2)]
    results = run(core, requests)
    for (_, params), result in zip(requests, results, strict=True):
        if result.final.finish_reason == "length":
            assert params.seed is not None and len(result.token_ids) == MAX_TOKENS
        else:
            assert result.final.finish_reason == "stop" and isinstance(json.loads(result.text), dict), result.text
    assert sum(r.final.finish_reason == "stop" for r in results) >= 8


@pytest.mark.parametrize(("spec", "message"), [
    (StructuredSpec("regex", "a(b"), "invalid regex: "),
    (StructuredSpec("json_schema", '{"type": "string", "minLength": 3, "maxLength": 1}'), "invalid json_schema: "),
])
def test_a_spec_that_does_not_compile_is_refused_with_a_400(spec, message):
    core = eh.make_core(LLAMA)
    [answer] = core.add_request(GenerateRequest("bad", [1, 2, 3], constrained(spec)))
    assert (answer.finished, answer.finish_reason, answer.error_code) == (True, "error", 400)
    assert answer.error.startswith(message) and not core.has_work()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_forked_choices_each_follow_their_own_grammar(async_scheduling):
    """n=4 sampled choices of one constrained request: each forked choice has its own matcher at the
    fork's place (not its parent's), so every choice is valid JSON of the schema and they differ."""
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue", "black"]},
                                               "size": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["colour", "size"], "additionalProperties": False}
    core = eh.make_core(LLAMA, async_scheduling=async_scheduling)
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=5, n=4, structured=as_json(schema))
    rid = eh.submit(core, prompts(1, seed=9)[0], params)
    results = eh.run_choices(core, [rid])
    texts = [results[rid, i].text for i in range(4)]
    for text in texts:
        check(json.loads(text), schema)
    assert len(set(texts)) > 1
    assert all(results[rid, i].final.finish_reason == "stop" for i in range(4))
    assert eh.blocks_in_use(core.kv) == 0
